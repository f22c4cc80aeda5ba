"""Step signposts (custom_ops/signpost/tfm_signpost.c and its ctypes binding), checked without a Mac.

The C source is compiled here against stand-ins for <os/log.h> and <os/signpost.h>
that record every emitted interval (tests/callbacks/signpost_stubs/); the stand-in
macros, like Apple's, only accept string literals as name and format. What stays
unverified here: Apple's real headers and Instruments (`pytest -m metal` on a Mac).
"""

import ctypes
import sys
from pathlib import Path

import pytest

from tfmetal_ext.callbacks import _signpost

STUBS = Path(__file__).resolve().parent / "signpost_stubs"


@pytest.fixture(scope="module")
def stub_library(tmp_path_factory):
    cc = _signpost.find_c_compiler()
    if cc is None:
        pytest.skip("no C compiler (clang or cc) on this machine")
    out = tmp_path_factory.mktemp("signpost") / "libtfm_signpost_stub.so"
    return _signpost.build(_signpost.source_path(), out, cc, extra_flags=[f"-I{STUBS}", str(STUBS / "stub_impl.c")])


def _events(path):
    lib = ctypes.CDLL(str(path))
    lib.tfm_stub_events.restype = ctypes.c_char_p
    return [e for e in lib.tfm_stub_events().decode().split(";") if e]


pytestmark = pytest.mark.no_keras


def test_source_ships_with_the_package():
    assert _signpost.source_path().is_file()


def test_not_macos_means_no_op():
    if sys.platform == "darwin":
        pytest.skip("checks the non-macOS path")
    posts = _signpost.Signposts.for_this_host()
    assert not posts.active
    assert posts.begin(3) == 0
    posts.end(0, 3)  # nothing to call: must not raise


def test_intervals_name_the_subsystem_and_step(stub_library):
    posts = _signpost.Signposts.from_library(stub_library)
    assert posts.active
    first = posts.begin(7)
    second = posts.begin(8)
    assert first != 0 and second != first
    posts.end(first, 7)
    posts.end(second, 8)
    assert _events(stub_library) == [
        f"tfmetal_ext/PointsOfInterest begin step id={first} step 7",
        f"tfmetal_ext/PointsOfInterest begin step id={second} step 8",
        f"tfmetal_ext/PointsOfInterest end step id={first} step 7",
        f"tfmetal_ext/PointsOfInterest end step id={second} step 8",
    ]


def test_a_failed_build_warns_once_and_turns_signposts_off(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(tmp_path))
    monkeypatch.setattr(_signpost, "find_c_compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        posts = _signpost.Signposts.for_this_host()
    assert not posts.active


def test_a_compile_error_carries_the_compiler_output(tmp_path):
    cc = _signpost.find_c_compiler()
    if cc is None:
        pytest.skip("no C compiler (clang or cc) on this machine")
    bad = tmp_path / "bad.c"
    bad.write_text("int f( {\n")
    with pytest.raises(RuntimeError, match="bad.c"):
        _signpost.build(bad, tmp_path / "libbad.so", cc)
    assert not (tmp_path / "libbad.so").exists()


def test_macos_path_builds_into_the_cache_once(monkeypatch, tmp_path, stub_library):
    # On "macOS", the library is built into the cache on first use and reused after.
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setenv("TFMETAL_EXT_CACHE", str(tmp_path))
    calls = []

    def fake_build(source, output, compiler, extra_flags=()):
        calls.append(output)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_bytes(Path(stub_library).read_bytes())
        return output

    monkeypatch.setattr(_signpost, "build", fake_build)
    monkeypatch.setattr(_signpost, "find_c_compiler", lambda: "cc")
    assert _signpost.Signposts.for_this_host().active
    assert _signpost.Signposts.for_this_host().active
    assert len(calls) == 1 and calls[0].parent == tmp_path / "signpost"
