"""The hub suite's machinery: where the test files come from, the swap and its undoing, a current baseline."""

import subprocess
import sys

import pytest

keras_hub = pytest.importorskip("keras_hub", reason="keras-hub is not installed (extra [hub])")

from keras_hub.src.models.llama import llama_attention, llama_decoder  # noqa: E402

from tests.hub_suite import swap  # noqa: E402
from tfmetal_ext.integrations import keras_hub as kh  # noqa: E402

_TEST_TEXT = "from keras_hub.src.tests.test_case import TestCase\n\n\nclass FakeTest(TestCase):\n" \
             "    def test_one(self):\n        pass\n"


# The files these tests load are modules of their own, apart from the suite's (which the swap rebinds).
_PREFIX = "hub_suite_check"


def _forget_checked_modules():
    for name in [n for n in sys.modules if n.startswith(_PREFIX + ".")]:
        del sys.modules[name]


def _tree(root, version):
    (root / "keras_hub/src/layers/modeling").mkdir(parents=True)
    (root / "keras_hub/src/version.py").write_text(f'__version__ = "{version}"\n')
    (root / "keras_hub/src/layers/modeling/rotary_embedding_test.py").write_text(_TEST_TEXT)
    return root


def _git(*args, cwd):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_the_tree_is_a_checkout_or_a_git_dir_of_the_installed_minor(tmp_path, monkeypatch):
    major_minor = ".".join(keras_hub.__version__.split(".")[:2])
    checkout = _tree(tmp_path / "checkout", f"{major_minor}.7.dev0")
    found = swap.source(str(checkout))
    assert not found.git_dir and found.read("keras_hub/src/version.py").startswith("__version__")
    module = swap.load(found, "layers/modeling/rotary_embedding_test.py", prefix=_PREFIX)
    assert list(swap.test_classes(module)) == ["FakeTest"]
    assert swap.load(found, "models/llama/llama_backbone_test.py", prefix=_PREFIX) is None

    # A bare git directory (what a mirror is): read at HEAD.
    _git("init", "-q", cwd=checkout)
    _git("add", "keras_hub", cwd=checkout)
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "t", cwd=checkout)
    _git("clone", "-q", "--bare", str(checkout), str(tmp_path / "bare.git"), cwd=tmp_path)
    bare = swap.source(str(tmp_path / "bare.git"))
    assert bare.git_dir and bare.version() == f"{major_minor}.7.dev0"
    assert bare.read("keras_hub/src/layers/modeling/rotary_embedding_test.py") == _TEST_TEXT
    assert bare.read("keras_hub/src/nothing.py") is None

    with pytest.raises(swap.SourceUnavailable, match="is keras-hub 0.1.0, the installed keras-hub is"):
        swap.source(str(_tree(tmp_path / "old", "0.1.0")))
    with pytest.raises(swap.SourceUnavailable, match="neither a keras-hub checkout"):
        swap.source(str(tmp_path))
    monkeypatch.delenv(swap.SRC_ENV, raising=False)
    with pytest.raises(swap.SourceUnavailable, match=f"{swap.SRC_ENV} is not set"):
        swap.source()
    _forget_checked_modules()


def test_the_swap_builds_ours_inside_and_is_undone_after():
    stock = llama_attention.LlamaAttention
    fused = kh.FUSED[stock]
    kwargs = dict(intermediate_dim=8, num_query_heads=2, num_key_value_heads=1)
    with swap.swapped(kh.FUSED) as built:
        # keras-hub's own constructor (the decoder builds its attention by the global name) builds ours.
        assert llama_decoder.LlamaAttention is fused and llama_attention.LlamaAttention is fused
        decoder = llama_decoder.LlamaTransformerDecoder(**kwargs)
        decoder.build((1, 3, 8))
        assert type(decoder._self_attention_layer) is fused
        assert fused in built and "__new__" in vars(fused)
    assert llama_decoder.LlamaAttention is stock and llama_attention.LlamaAttention is stock
    assert "__new__" not in vars(fused)
    decoder = llama_decoder.LlamaTransformerDecoder(**kwargs)
    decoder.build((1, 3, 8))
    assert type(decoder._self_attention_layer) is stock


def test_the_variant_is_checked(monkeypatch):
    monkeypatch.setenv(swap.VARIANT_ENV, "bare")
    with pytest.raises(ValueError, match="Received: TFMETAL_EXT_HUB_SUITE_VARIANT='bare'"):
        swap.variant()


def test_baseline_is_current_and_explains_only_what_stock_passes():
    baseline = swap.load_baseline()
    assert baseline is not None and baseline["keras_hub"] == keras_hub.__version__, (
        "regenerate: TFMETAL_EXT_KERAS_HUB_SRC=... python -m tests.hub_suite.make_baseline")
    for file, data in baseline["files"].items():
        for name, entry in data["tests"].items():
            assert entry["stock"] in ("passed", "failed", "skipped"), (file, name, entry)
        # An explanation names a test keras-hub's own classes pass (else it is gated already) that ours
        # fails, with its reason.
        for name, reason in data["explained"].items():
            assert data["tests"][name]["stock"] == "passed" != data["tests"][name]["ours"], (file, name)
            assert isinstance(reason, str) and len(reason) > 20, (file, name, reason)
    try:
        src = swap.source()
    except swap.SourceUnavailable as e:
        pytest.skip(f"the recorded names are checked against keras-hub's files: {e}")
    for test_file in swap.TEST_FILES:
        module = swap.load(src, test_file, prefix=_PREFIX)
        key = swap.file_key(test_file)
        if module is None:
            assert key not in baseline["files"], f"{test_file} is gone: regenerate the baseline"
            continue
        names = {f"{c}::{a}" for c, cls in swap.test_classes(module).items() for a in dir(cls)
                 if a.startswith("test")}
        assert names == set(baseline["files"][key]["tests"]), f"{key}: regenerate the baseline"
    _forget_checked_modules()
