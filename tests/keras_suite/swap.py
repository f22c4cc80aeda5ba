"""Keras' own test files, run with a tfmetal_ext class swapped in for the stock one.

The drop-in contract (issue 27): Keras' test file for a replaced class must
pass with our class in its place wherever it passes with Keras' own class,
except the tests that check the class's identity, which `baseline.json`
lists (``identity``) with the reason for each. The tests Keras' own class
does not pass here (a skip, a backend it does not support) say nothing
about a drop-in and are gated with Keras' own reason.

`baseline.json` is made by running each file twice (`make_baseline`): with
Keras' own class (``stock``: what a drop-in must match) and with a bare
subclass of it (``bare``: ``class BareDense(keras.layers.Dense): pass``,
registered, whose ``__new__`` records which tests build the class; a test
that never builds it, the file's Conv1D cases say, does not test it).

How the swap works. The Keras test file is loaded from the installed
package (never copied: it tracks the installed Keras) as a fresh module of
its own, whose ``__import__`` hands out read-through views of the Keras
modules it imports: in that view ``keras.src.layers.Dense`` (and
``keras.layers.Dense``, ``keras.src.optimizers.adam.Adam``...) is the
swapped-in class, every other name is Keras' own. Nothing global changes:
Keras, our layers (which may build stock layers internally) and every other
test see the real modules. Parameters evaluated when the file is imported
(``@parameterized`` lists holding ``layers.Conv2D``) see the swapped class
too.

Which stock class a tfmetal_ext class replaces is read from the fusion
table (`tfmetal_ext.backends.fusion.STOCK_TO_FUSED` /
`OPTIMIZER_TO_FUSED` / `LOSS_TO_FUSED`); this module only knows which Keras test file tests
which stock class.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib
import importlib.util
import json
import pathlib
import sys
import threading
import types

import keras

from tfmetal_ext.backends import fusion

KERAS_SRC = pathlib.Path(keras.src.__file__).parent
BASELINE_PATH = pathlib.Path(__file__).with_name("baseline.json")

# The variant a run swaps in: "ours" (the tfmetal_ext class, what CI runs), "stock"
# (Keras' own class) or "bare" (a bare subclass of the stock class); `make_baseline`
# runs the last two.
VARIANT_ENV = "TFMETAL_EXT_KERAS_SUITE_VARIANT"


@dataclasses.dataclass(frozen=True)
class Suite:
    """One stock class and the Keras test file that tests it.

    Attributes:
        stock: the stock class name, a key of `STOCK_TO_FUSED` or
            `OPTIMIZER_TO_FUSED`.
        test_file: the Keras test file, relative to ``keras/src``.
        homes: the modules through which a test file can reach the stock
            class (each gets the swapped class under the stock name).
    """

    stock: str
    test_file: str
    homes: tuple

    @property
    def replacement(self):
        for table in (fusion.OPTIMIZER_TO_FUSED, fusion.LOSS_TO_FUSED, fusion.STOCK_TO_FUSED):
            if self.stock in table:
                return table[self.stock]
        raise KeyError(self.stock)

    @property
    def stock_class(self):
        return getattr(importlib.import_module(self.homes[0]), self.stock)

    @property
    def ours(self):
        row = self.replacement
        return getattr(importlib.import_module(row.module), row.fused)


_LAYER_HOMES = ("keras.src.layers", "keras.layers")


def _optimizer_homes(module):
    return (f"keras.src.optimizers.{module}", "keras.src.optimizers", "keras.optimizers")


SUITES = types.MappingProxyType(
    {
        s.stock: s
        for s in (
            Suite("BatchNormalization", "layers/normalization/batch_normalization_test.py", _LAYER_HOMES),
            Suite("LayerNormalization", "layers/normalization/layer_normalization_test.py", _LAYER_HOMES),
            Suite("RMSNormalization", "layers/normalization/rms_normalization_test.py", _LAYER_HOMES),
            Suite("Dense", "layers/core/dense_test.py", _LAYER_HOMES),
            Suite("EinsumDense", "layers/core/einsum_dense_test.py", _LAYER_HOMES),
            Suite("Conv2D", "layers/convolutional/conv_test.py", _LAYER_HOMES),
            Suite("DepthwiseConv2D", "layers/convolutional/depthwise_conv_test.py", _LAYER_HOMES),
            Suite("Conv1D", "layers/convolutional/conv_test.py", _LAYER_HOMES),
            Suite("SeparableConv2D", "layers/convolutional/separable_conv_test.py", _LAYER_HOMES),
            Suite("LSTM", "layers/rnn/lstm_test.py", _LAYER_HOMES),
            Suite("GRU", "layers/rnn/gru_test.py", _LAYER_HOMES),
            Suite("MultiHeadAttention", "layers/attention/multi_head_attention_test.py", _LAYER_HOMES),
            Suite("Dropout", "layers/regularization/dropout_test.py", _LAYER_HOMES),
            Suite("Embedding", "layers/core/embedding_test.py", _LAYER_HOMES),
            Suite("Adam", "optimizers/adam_test.py", _optimizer_homes("adam")),
            Suite("AdamW", "optimizers/adamw_test.py", _optimizer_homes("adamw")),
            Suite("SGD", "optimizers/sgd_test.py", _optimizer_homes("sgd")),
            Suite("RMSprop", "optimizers/rmsprop_test.py", _optimizer_homes("rmsprop")),
            Suite("Adagrad", "optimizers/adagrad_test.py", _optimizer_homes("adagrad")),
            Suite("Lion", "optimizers/lion_test.py", _optimizer_homes("lion")),
            Suite("SparseCategoricalCrossentropy", "losses/losses_test.py",
                  ("keras.src.losses.losses", "keras.src.losses", "keras.losses")),
        )
    }
)

# ----------------------------------------------------------------------------
# Which test is running, and whether it built the swapped-in class.

_state = threading.local()


def set_current_test(key):
    _state.key = key


def current_test():
    return getattr(_state, "key", None)


_instantiated = {}  # test key -> set of suite names whose bare class it built


def instantiated(key):
    return _instantiated.get(key, set())


def bare_class(suite):
    """A registered bare subclass of the stock class (what a user's own subclass would be).

    The only addition is a ``__new__`` that records which test built one
    (so the baseline knows which tests exercise the class at all); it hands
    on every argument unchanged.
    """
    stock = suite.stock_class
    name = f"Bare{suite.stock}"

    def __new__(cls, *args, **kwargs):
        key = current_test()
        if key is not None:
            _instantiated.setdefault(key, set()).add(suite.stock)
        parent = super(bare, cls).__new__
        if parent is object.__new__:
            return parent(cls)
        return parent(cls, *args, **kwargs)

    bare = type(name, (stock,), {"__new__": __new__, "__module__": __name__, "__qualname__": name})
    return keras.saving.register_keras_serializable(package="keras_suite_bare")(bare)


# ----------------------------------------------------------------------------
# Module views.


class _ModuleView(types.ModuleType):
    """A read-through view of `module` (reached as `path`) with some names swapped."""

    def __init__(self, module, path, swaps):
        super().__init__(module.__name__, module.__doc__)
        object.__setattr__(self, "_view_module", module)
        object.__setattr__(self, "_view_path", path)
        object.__setattr__(self, "_view_swaps", swaps)

    def __getattr__(self, attr):
        path = f"{self._view_path}.{attr}"
        if path in self._view_swaps:
            return self._view_swaps[path]
        return _view(getattr(self._view_module, attr), path, self._view_swaps)

    def __dir__(self):
        return dir(self._view_module)

    def __repr__(self):
        return f"<view of {self._view_module!r} swapping {sorted(self._view_swaps)}>"


def _view(value, path, swaps):
    if isinstance(value, types.ModuleType) and any(s.startswith(path + ".") for s in swaps):
        return _ModuleView(value, path, swaps)
    return value


def _importer(swaps):
    real_import = builtins.__import__

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        if level:
            return module
        return _view(module, name if fromlist else name.split(".")[0], swaps)

    return __import__


def load(suite, cls, module_name):
    """Imports `suite`'s Keras test file as `module_name`, with `cls` as the stock class."""
    path = KERAS_SRC / suite.test_file
    if not path.is_file():
        raise FileNotFoundError(f"Keras {keras.__version__} has no {suite.test_file} (looked in {KERAS_SRC})")
    swaps = {f"{home}.{suite.stock}": cls for home in suite.homes}
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    module.__builtins__ = dict(vars(builtins), __import__=_importer(swaps))
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def test_classes(module):
    """The `unittest.TestCase` classes the Keras test file defines."""
    import unittest

    return {
        name: obj
        for name, obj in vars(module).items()
        if isinstance(obj, type) and issubclass(obj, unittest.TestCase) and obj.__module__ == module.__name__
    }


def variant():
    import os

    value = os.environ.get(VARIANT_ENV, "ours")
    if value not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV} must be one of {VARIANTS}. Received: {VARIANT_ENV}={value!r}")
    return value


VARIANTS = ("ours", "stock", "bare")


def swapped_class(suite, which):
    if which == "ours":
        return suite.ours
    if which == "stock":
        return suite.stock_class
    return bare_class(suite)


def test_key(nodeid):
    """``Dense::DenseTest::test_x`` from a node id of the generated test module."""
    name = nodeid.split("::", 1)[1]
    suite, _, rest = name.partition("__")
    return suite, rest


def load_baseline():
    if not BASELINE_PATH.is_file():
        return None
    return json.loads(BASELINE_PATH.read_text())
