"""keras-hub's own test files, run with the fusion-first subclasses of `tfmetal_ext.integrations.keras_hub`.

The drop-in contract of the keras-hub integration: keras-hub's test files
for the model families whose layers it replaces pass with our subclasses
built in place of keras-hub's classes wherever they pass with keras-hub's
own, except the failures `baseline.json` explains (``explained``). Tests
keras-hub's own classes do not pass here (``large`` / ``extra_large`` /
``kaggle_key_required`` marks, presets, another backend) are gated with
keras-hub's own reason.

Where the test files come from. keras-hub's wheel ships
``keras_hub/src/tests/test_case.py`` but not its test files or test data,
and CI cannot download them, so they are read from a keras-hub source tree
named by ``TFMETAL_EXT_KERAS_HUB_SRC``: a checkout (a directory holding
``keras_hub/src``) or a git directory (bare or ``.git``; its ``HEAD`` is
read with ``git show``). Nothing is copied into this repository. Without
the variable, or when the tree's version differs from the installed
keras-hub's major.minor, the suite skips and says why.

How the swap works. Each file is loaded as a fresh module of its own. During
each of its tests (and only then: `swapped` undoes it), every module-level
name of the loaded ``keras_hub.src.*`` modules and of the loaded test
modules whose value is a key of `FUSED` (keras-hub class -> our subclass) is
bound to our subclass, so keras-hub's own constructors (a decoder building
``LlamaAttention(...)``, ``RotaryEmbedding(...)``, its norms) build ours.
Classes keras-hub subclasses from them keep their stock base.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import types
import unittest

SRC_ENV = "TFMETAL_EXT_KERAS_HUB_SRC"
# The classes a run builds: "ours" (our subclasses, what CI runs) or "stock" (keras-hub's own);
# `make_baseline` runs both.
VARIANT_ENV = "TFMETAL_EXT_HUB_SUITE_VARIANT"
VARIANTS = ("ours", "stock")
BASELINE_PATH = pathlib.Path(__file__).with_name("baseline.json")

# keras-hub's test files for the layers and model families the integration converts, relative to
# keras_hub/src (those absent from the tree are left out, e.g. Qwen has no backbone test).
TEST_FILES = (
    "layers/modeling/rotary_embedding_test.py",
    "layers/modeling/cached_multi_head_attention_test.py",
    "layers/modeling/transformer_decoder_test.py",
    *(f"models/{family}/{family}_{kind}_test.py"
      for family in ("llama", "mistral", "qwen", "gemma", "gpt2")
      for kind in ("backbone", "causal_lm")),
    "models/bert/bert_backbone_test.py",
    "models/bert/bert_text_classifier_test.py",
)

# keras-hub's pytest marks (its conftest.py, which is not in the wheel) and when they skip.
KERAS_HUB_MARKS = {
    "large": "keras-hub's `large` mark (slow or needs a network): keras-hub runs it with --run_large, "
             "this suite always",
    "extra_large": "keras-hub's `extra_large` mark (presets, too large to run continuously): "
                   "keras-hub runs it with --run_extra_large",
    "kaggle_key_required": "keras-hub's `kaggle_key_required` mark: needs a Kaggle API key",
    "tf_only": "keras-hub's `tf_only` mark (runs on the TensorFlow backend: here it does)",
    "multi_device": "keras-hub's `multi_device` mark (distribution tests; they skip themselves off JAX)",
}


# ----------------------------------------------------------------------------
# The source tree.


class SourceUnavailable(Exception):
    """Why keras-hub's test files cannot be read (the suite skips with this message)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A keras-hub source tree: a checkout directory or a git directory (read at ``HEAD``)."""

    path: pathlib.Path
    git_dir: bool

    def read(self, relpath):
        """The text of `relpath` (from the tree's root, e.g. ``keras_hub/src/version.py``), or None."""
        if not self.git_dir:
            file = self.path / relpath
            return file.read_text() if file.is_file() else None
        done = subprocess.run(["git", "--git-dir", str(self.path), "show", f"HEAD:{relpath}"],
                              capture_output=True, text=True)
        return done.stdout if done.returncode == 0 else None

    def where(self, relpath):
        """A name for `relpath` in tracebacks."""
        return str(self.path / relpath) if not self.git_dir else f"{self.path}@HEAD:{relpath}"

    def version(self):
        text = self.read("keras_hub/src/version.py")
        found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text or "", re.M)
        if found is None:
            raise SourceUnavailable(f"{self.where('keras_hub/src/version.py')} has no __version__")
        return found.group(1)

    def export_test_data(self, into):
        """keras-hub's test data (``keras_hub/src/tests/test_data``) as a directory; `into` is used for a git dir."""
        if not self.git_dir:
            return self.path / "keras_hub/src/tests/test_data"
        archive = subprocess.run(["git", "--git-dir", str(self.path), "archive", "HEAD",
                                  "keras_hub/src/tests/test_data"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        return pathlib.Path(into) / "keras_hub/src/tests/test_data"


def _major_minor(version):
    return tuple(version.split(".")[:2])


def source(path=None):
    """The keras-hub tree `path` (default: ``$TFMETAL_EXT_KERAS_HUB_SRC``), checked against the installed keras-hub.

    Raises `SourceUnavailable` with the reason when it is not set, not a
    keras-hub tree, or of another major.minor version.
    """
    import keras_hub

    path = path if path is not None else os.environ.get(SRC_ENV)
    if not path:
        raise SourceUnavailable(
            f"{SRC_ENV} is not set: keras-hub's wheel has no test files; point it at a keras-hub source checkout "
            f"or git directory of version {'.'.join(_major_minor(keras_hub.__version__))}.x")
    path = pathlib.Path(path).expanduser()
    if (path / "keras_hub/src").is_dir():
        found = Source(path, git_dir=False)
    elif (path / "HEAD").is_file() and (path / "objects").is_dir():
        found = Source(path, git_dir=True)
    elif (path / ".git").is_dir():
        found = Source(path / ".git", git_dir=True)
    else:
        raise SourceUnavailable(f"{SRC_ENV}={str(path)!r} is neither a keras-hub checkout (with keras_hub/src) "
                                "nor a git directory")
    version = found.version()
    if _major_minor(version) != _major_minor(keras_hub.__version__):
        raise SourceUnavailable(f"{SRC_ENV}={str(path)!r} is keras-hub {version}, the installed keras-hub is "
                                f"{keras_hub.__version__}: their test files need not match")
    return found


# ----------------------------------------------------------------------------
# Loading the test files.

MODULE_PREFIX = "hub_suite_files"


class _Absent(types.ModuleType):
    """A stand-in for a module keras-hub's test_case.py imports but only a few of its checks use."""

    def __getattr__(self, attr):
        raise ModuleNotFoundError(f"{self.__name__} is not installed: keras-hub's test_case.py uses "
                                  f"{self.__name__}.{attr} (pip install keras-hub[{self.__name__}])")


def import_test_case():
    """keras-hub's ``keras_hub.src.tests.test_case`` (in its wheel), which the test files import.

    It imports ``grain`` (keras-hub's optional ``[grain]`` extra) for its
    Grain-pipeline checks of preprocessors. Without it, the module sees a
    stand-in that raises `ModuleNotFoundError` where a check uses it; the
    stand-in is in ``sys.modules`` only while test_case.py is imported.
    """
    if "keras_hub.src.tests.test_case" in sys.modules:
        return sys.modules["keras_hub.src.tests.test_case"]
    stub = None
    if importlib.util.find_spec("grain") is None:
        stub = sys.modules["grain"] = _Absent("grain")
    try:
        return importlib.import_module("keras_hub.src.tests.test_case")
    finally:
        if stub is not None and sys.modules.get("grain") is stub:
            del sys.modules["grain"]


def file_key(test_file):
    """``llama_causal_lm_test`` for ``models/llama/llama_causal_lm_test.py`` (file names are unique)."""
    return pathlib.PurePosixPath(test_file).stem


def load(src, test_file, prefix=MODULE_PREFIX):
    """keras-hub's `test_file` (relative to keras_hub/src) as a fresh module, or None when the tree lacks it.

    The module is ``{prefix}.{file_key}`` in ``sys.modules``: the suite's
    (`MODULE_PREFIX`) are among the modules `swapped` rebinds.
    """
    relpath = f"keras_hub/src/{test_file}"
    text = src.read(relpath)
    if text is None:
        return None
    import_test_case()
    name = f"{prefix}.{file_key(test_file)}"
    module = types.ModuleType(name)
    module.__file__ = src.where(relpath)
    sys.modules[name] = module
    exec(compile(text, module.__file__, "exec"), module.__dict__)
    return module


def test_classes(module):
    """The `unittest.TestCase` classes the test file defines."""
    return {n: c for n, c in vars(module).items()
            if isinstance(c, type) and issubclass(c, unittest.TestCase) and c.__module__ == module.__name__}


def variant():
    value = os.environ.get(VARIANT_ENV, "ours")
    if value not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV} must be one of {VARIANTS}. Received: {VARIANT_ENV}={value!r}")
    return value


def test_key(nodeid):
    """(file key, ``Class::test``) from a node id of `test_hub_suite.py` (``...::<file>__<Class>::<test>``)."""
    _, cls, name = nodeid.split("::", 2)
    key, _, cls = cls.partition("__")
    return key, f"{cls}::{name}"


# ----------------------------------------------------------------------------
# The swap.

_built = set()  # our subclasses built since `swapped` began


def _modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name.startswith("keras_hub.src.") or name.startswith(MODULE_PREFIX + "."))]


@contextlib.contextmanager
def swapped(fused):
    """Within: the names of keras-hub's loaded modules bound to a key of `fused` are bound to its value.

    Yields the set of our subclasses built inside (a recording ``__new__``
    on each, which hands its arguments on unchanged, removed after).
    """
    undo = []
    try:
        for module in _modules():
            for name, value in list(vars(module).items()):
                if isinstance(value, type) and value in fused:
                    undo.append((module, name, value))
                    setattr(module, name, fused[value])
        for cls in fused.values():
            if "__new__" not in vars(cls):
                type.__setattr__(cls, "__new__", staticmethod(_recording_new(cls)))
                undo.append((cls, "__new__", None))
        _built.clear()
        yield _built
    finally:
        for target, name, value in reversed(undo):
            if value is None:
                type.__delattr__(target, name)
            else:
                setattr(target, name, value)


def _recording_new(cls):
    def __new__(kind, *args, **kwargs):
        _built.add(cls)
        return super(cls, kind).__new__(kind, *args, **kwargs)

    return __new__


def load_baseline():
    return json.loads(BASELINE_PATH.read_text()) if BASELINE_PATH.is_file() else None


def temp_dir():
    return tempfile.mkdtemp(prefix="hub_suite_")
