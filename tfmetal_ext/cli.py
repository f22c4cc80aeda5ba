"""The `tfmetal-ext` command line: `version`, `report`, `build-ops`, `doctor`, `convert`, `export`, `to-stock`.

`doctor [--selftest] [--json]`: environment, configure() choice, custom-op status
and, with --selftest, each fused pattern checked on the device (exit 1 on a FAIL).
`report MODEL.keras [--predict-for NAME [--macos VERSION]]`: fusion and placement of the model's step here, or its
predicted placement on a Metal backend (tensorflow-metal-plugin, tensorflow-metal).
`convert IN.keras OUT.keras [--inference [--quantize int8]]`: a fusion-first, verified copy of a saved
model (with --quantize int8: int8 weights, checked against the float inference form).
`export MODEL.keras OUT --format litert|onnx|tf_saved_model|openvino|coreml [--int8] [--float16]`: a deployable artifact
that needs no tfmetal_ext, reloaded with the format's runtime and compared with the model (exit 1 if it differs).
`to-stock IN.keras OUT.keras`: the same model built from stock Keras layers, verified; its file loads where
tfmetal_ext is not installed (checked in a process without it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _cmd_version(args):
    from tfmetal_ext import __version__, devices

    caps = devices.capabilities()
    if args.json:
        print(json.dumps({"tfmetal_ext": __version__, **caps.to_dict()}, indent=2))
        return 0
    print(f"tfmetal-ext {__version__}")
    print(f"tensorflow {caps.tf_version}, keras {caps.keras_version}")
    print("\n".join(devices.describe_pairing(caps)))
    return 0


def _usage_error(command, text):
    """One line on stderr; exit status 2 (1 is for failed verification)."""
    print(f"tfmetal-ext {command}: {text}", file=sys.stderr)
    return 2


def _output_problem(path):
    """Why a converted model can't be saved at `path` (a sentence naming the fix), or None."""
    if os.path.isdir(path):
        return f"{path} is a directory; give a file name ending in .keras, e.g. {os.path.join(path, 'model.keras')}"
    if not path.endswith(".keras"):
        return f"the output must be a .keras file; received: {path} (add the .keras suffix)"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"the output's directory does not exist: {parent} (create it first)"
    if not os.access(parent, os.W_OK):
        return f"the output's directory is not writable: {parent} (choose another directory)"
    return None


def _load_model(path, command):
    """The Keras model saved at `path`, or None after printing why not (exit status 2)."""
    import keras

    if not os.path.exists(path):
        print(f"tfmetal-ext {command}: no such file: {path}", file=sys.stderr)
        return None
    try:
        return keras.saving.load_model(path)
    except Exception as e:  # Keras raises several types for unreadable files
        print(f"tfmetal-ext {command}: cannot load {path}: {e}", file=sys.stderr)
        return None


def _cmd_report(args):
    from tfmetal_ext import inspect

    if args.macos is not None and args.predict_for is None:
        print("tfmetal-ext report: --macos applies to a prediction only: pass --predict-for too", file=sys.stderr)
        return 2
    if args.no_gap_kernels and args.predict_for is None:
        print("tfmetal-ext report: --no-gap-kernels applies to a prediction only: pass --predict-for too",
              file=sys.stderr)
        return 2
    if args.predict_for is not None:
        from tfmetal_ext.inspect import predict

        try:
            predict.validate_predict_for(args.predict_for)
            predict.macos_version(args.macos)
        except ValueError as e:
            print(f"tfmetal-ext report: {e}", file=sys.stderr)
            return 2
    model = _load_model(args.model, "report")
    if model is None:
        return 2
    kw = {"batch_size": args.batch}
    if args.mode == "train" and not getattr(model, "compiled", False):
        kw.update(optimizer=args.optimizer, loss=args.loss)
    if args.predict_for:
        # Traced as on that backend, not run: this host's fusion report says nothing about it.
        predicted = inspect.placement_report(model, mode=args.mode, predict_for=args.predict_for, macos=args.macos,
                                             gap_kernels=not args.no_gap_kernels, **kw)
        print(json.dumps({"predicted_placement": predicted.to_dict()}, indent=2) if args.json else predicted)
        return 0
    fusion = inspect.fusion_report(model, mode=args.mode, **kw)
    placement = inspect.placement_report(model, mode=args.mode, **kw)
    if args.json:
        print(json.dumps({"fusion": fusion.to_dict(), "placement": placement.to_dict()}, indent=2))
    else:
        print(fusion)
        print(placement)
    return 0


def _cmd_build_ops(args):
    from tfmetal_ext.ops import _loader

    try:
        p = _loader.build(force=args.force)
    except _loader.BuildError as e:
        print(f"tfmetal-ext build-ops: {e}", file=sys.stderr)
        return 1
    except _loader.OpCacheError as e:  # refused for safety: the message names the path and the fix
        return _usage_error("build-ops", " ".join(str(e).split()))
    except (OSError, ValueError, RuntimeError) as e:
        where = getattr(e, "filename", None) or os.environ.get("TFMETAL_EXT_CACHE") or "the op cache"
        text = " ".join(str(e).split())
        return _usage_error(
            "build-ops", f"cannot use the op cache ({where}): {text} (point TFMETAL_EXT_CACHE at a writable "
            "directory you own)"
        )
    metal = "with Metal kernels" if p.with_metal else "CPU kernels only (Metal kernels build on macOS arm64)"
    print(f"{p.library}\nbuilt for TensorFlow {p.tf_version}, {metal}")
    return 0


def _cmd_doctor(args):
    from tfmetal_ext import doctor

    info = doctor.collect()
    result = doctor.selftest() if args.selftest else None
    if args.json:
        print(json.dumps({"doctor": info.to_dict(), "selftest": result.to_dict() if result else None}, indent=2))
    else:
        print(info)
        if result is not None:
            print()
            print(result)
    # An environment error (a broken Metal pairing, both Metal plugins installed) fails the doctor too.
    return 0 if (result is None or result.passed) and not getattr(info, "errors", None) else 1


def _cmd_convert(args):
    from tfmetal_ext import conversion

    if args.quantize and not args.inference:
        return _usage_error("convert", f"--quantize {args.quantize} needs --inference: the quantized model is "
                            "the deployment form (batch norms folded); add --inference")
    return _rewrite_file(
        "convert", args,
        lambda model: conversion.convert(model, inference=args.inference, verify=not args.no_verify,
                                         count_ops=not args.no_ops, batch_size=args.batch, quantize=args.quantize),
        (lambda new: _reload_problem(new, args.output, args.batch)) if args.quantize else None,
        " (loaded back: predicts the same)",
    )


def _rewrite_file(command, args, make, reload_problem, checked):
    """`convert` and `to-stock`: IN.keras -> ``make(model)`` -> OUT.keras, then ``reload_problem(new)``.

    Exit 2 for an unusable IN or OUT (OUT checked before the work, which takes a while), 1 when
    `make` fails verification or the saved file fails `reload_problem` (then it is removed).
    """
    from tfmetal_ext import conversion

    if os.path.isdir(args.input) or (os.path.exists(args.input) and not args.input.endswith(".keras")):
        return _usage_error(command, f"the input must be a .keras file; received: {args.input}")
    problem = _output_problem(args.output)
    if problem:
        return _usage_error(command, problem)
    model = _load_model(args.input, command)
    if model is None:
        return 2
    try:
        new = make(model)
    except (ValueError, conversion.VerificationError) as e:
        print(f"tfmetal-ext {command}: {e}", file=sys.stderr)
        return 1
    try:
        new.save(args.output)
    except (OSError, ValueError) as e:
        return _usage_error(command, f"cannot save {args.output}: {' '.join(str(e).split())} (choose another path)")
    report = getattr(new, "conversion_report", None)
    problem = reload_problem(new) if reload_problem is not None else None
    if problem:
        os.remove(args.output)
        if report is not None:
            print(report)
        print(f"tfmetal-ext {command}: {problem}; {args.output} removed", file=sys.stderr)
        return 1
    if report is not None:
        print(report)
    print(f"saved {args.output}" + (checked if reload_problem is not None else ""))
    return 0


def _reload_problem(converted, path, batch):
    """Why the model saved at `path` does not load back and predict what `converted` does, or None.

    Checked for the int8 form: Keras makes a subclass's sublayers in float when loading, and such a
    file would not load at all.
    """
    import keras
    import numpy as np

    from tfmetal_ext.conversion.verify import as_numpy_list, make_inputs

    try:
        loaded = keras.saving.load_model(path)
    except Exception as e:  # Keras raises several types
        return f"the saved int8 model does not load back: {' '.join(str(e).split())[:400]}"
    try:
        x = make_inputs(converted, batch, 0)
    except ValueError:  # no synthetic data for it (string inputs): loading back is what could be checked
        return None
    for a, b in zip(as_numpy_list(converted(x, training=False)), as_numpy_list(loaded(x, training=False))):
        if a.shape != b.shape or not np.array_equal(a, b, equal_nan=True):
            return "the saved int8 model loads back but predicts differently from the converted one"
    return None


def _cmd_export(args):
    from tfmetal_ext import deploy

    fmt = deploy.FORMATS.get(args.format)
    if os.path.isdir(args.model) or (os.path.exists(args.model) and not args.model.endswith(".keras")):
        return _usage_error("export", f"the input must be a .keras file; received: {args.model}")
    parent = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(parent):
        return _usage_error("export", f"the output's directory does not exist: {parent} (create it first)")
    if fmt.suffix and not args.output.endswith(fmt.suffix):
        return _usage_error("export", f"a {fmt.name} export is a {fmt.suffix} file; received: {args.output} "
                            f"(add the {fmt.suffix} suffix)")
    if os.path.exists(args.output):
        return _usage_error("export", f"{args.output} exists; remove it or choose another path")
    missing = deploy.formats.missing_modules(fmt)
    if missing:
        return _usage_error("export", f"--format {fmt.name} needs {', '.join(fmt.pip)} "
                            "(pip install 'tfmetal-ext[export]'); not importable: " + "; ".join(missing))
    model = _load_model(args.model, "export")
    if model is None:
        return 2
    try:
        report = deploy.export(model, args.output, format=fmt.name, int8=args.int8, float16=args.float16,
                               verify=not args.no_verify, batch_size=args.batch)
    except (ValueError, deploy.ExportError) as e:
        print(f"tfmetal-ext export: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except ImportError as e:
        return _usage_error("export", " ".join(str(e).split()))
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0


def _cmd_to_stock(args):
    from tfmetal_ext import conversion

    return _rewrite_file(
        "to-stock", args,
        lambda model: conversion.to_stock(model, verify=not args.no_verify, batch_size=args.batch),
        None if args.no_verify else (lambda new: _isolated_reload_problem(new, args.output, args.batch)),
        " (loaded in a process without tfmetal_ext: predicts the same)",
    )


def _isolated_reload_problem(model, path, batch):
    """Why the .keras file at `path` does not load without tfmetal_ext and predict what `model` does, or None."""
    import keras
    import numpy as np

    from tfmetal_ext.conversion.verify import as_numpy_list, make_inputs
    from tfmetal_ext.deploy import runtimes

    try:
        x = make_inputs(model, batch, 0)
    except ValueError:  # no synthetic data for it (string inputs): loading is what can be checked
        x = None
    flat, structure = runtimes.input_structure(keras.tree.map_structure(np.asarray, x)) if x is not None \
        else ([], {"kind": "list", "keys": None})
    try:
        outs, _, _ = runtimes.run_without_tfmetal_ext("keras", path, flat, structure)
    except runtimes.RuntimeRefused as e:
        return str(e)
    if x is None:
        return None
    from tfmetal_ext.conversion.verify import rel_diff
    from tfmetal_ext.deploy import output_tolerance

    expected = as_numpy_list(model(x, training=False))
    worst = max((rel_diff(a, b) for a, b in zip(expected, outs)), default=0.0)
    if len(outs) != len(expected) or not worst <= output_tolerance(model):
        return f"the file loads without tfmetal_ext but predicts differently (max relative error {worst:.3g})"
    return None


def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser():
    parser = argparse.ArgumentParser(
        prog="tfmetal-ext", description="Keras 3 fusion tools for TensorFlow (Metal, CUDA, CPU)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("version", help="versions, backend and TF/tensorflow-metal pairing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_version)
    p = sub.add_parser("report", help="fusion and placement report of a saved .keras model")
    p.add_argument("model", help="path to a .keras file")
    p.add_argument("--mode", choices=("train", "predict"), default="train")
    p.add_argument("--batch", type=_positive_int, default=8, help="batch size of the random inputs")
    p.add_argument("--optimizer", default="adam", help="optimizer when the file holds no compile config")
    p.add_argument("--loss", default="mse", help="loss when the file holds no compile config")
    p.add_argument(
        "--predict-for", default=None, metavar="NAME",
        help="predict the placement on a Metal backend instead (tensorflow-metal-plugin or tensorflow-metal): "
             "the step is traced as there, not run, on any machine",
    )
    p.add_argument(
        "--macos", default=None, metavar="VERSION",
        help="with --predict-for: the macOS to predict for (e.g. 12.7; tensorflow-metal's stateless-random "
             "kernels need 13); default: this Mac's, or an assumed one named in the report",
    )
    p.add_argument(
        "--no-gap-kernels", action="store_true",
        help="with --predict-for: the backend alone, without the GPU kernels tfmetal_ext registers for the "
             "standard ops it lacks (as in a process that never imports tfmetal_ext)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_report)
    p = sub.add_parser("build-ops", help="build (or find in the cache) the custom-op library for this TensorFlow")
    p.add_argument("--force", action="store_true", help="rebuild even if a valid cached build exists")
    p.set_defaults(func=_cmd_build_ops)
    p = sub.add_parser("doctor", help="environment, configure() choice, custom ops; --selftest checks fused kernels")
    p.add_argument("--selftest", action="store_true", help="check each fused pattern on the device (exit 1 on FAIL)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_doctor)
    p = sub.add_parser("convert", help="rewrite a saved .keras model into fusion-first layers, verified")
    p.add_argument("input", help="path to the stock .keras file")
    p.add_argument("output", help="where to save the converted .keras file")
    p.add_argument("--inference", action="store_true", help="fold batch norms into the convolutions (deployment)")
    p.add_argument(
        "--quantize", choices=("int8",), default=None,
        help="with --inference: weight-only int8 kernels (a float32 scale per output channel), verified against "
             "the float inference form",
    )
    p.add_argument("--batch", type=_positive_int, default=2, help="batch size of verify's and op counting's inputs")
    p.add_argument("--no-verify", action="store_true", help="skip comparing outputs and gradients with the stock model")
    p.add_argument("--no-ops", action="store_true", help="skip counting ops per train step and inference call")
    p.set_defaults(func=_cmd_convert)
    from tfmetal_ext.deploy.formats import FORMATS

    p = sub.add_parser("export", help="a deployable artifact of a .keras model that needs no tfmetal_ext, checked")
    p.add_argument("model", help="path to a .keras file (tfmetal_ext layers or stock)")
    p.add_argument("output", help="where to write it (a directory for tf_saved_model and coreml)")
    p.add_argument("--format", required=True, choices=tuple(FORMATS), help="the export format")
    p.add_argument("--int8", action="store_true",
                   help="export the int8 deployment form (convert --inference --quantize int8 first)")
    p.add_argument("--float16", action="store_true",
                   help="litert: float16 weights; coreml: float16 compute (checked within the float16 bound)")
    p.add_argument("--batch", type=_positive_int, default=2, help="batch size of the check's inputs")
    p.add_argument("--no-verify", action="store_true", help="skip reloading it with the format's runtime")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_export)
    p = sub.add_parser("to-stock", help="a .keras model rebuilt from stock Keras layers (loads without tfmetal_ext)")
    p.add_argument("input", help="path to a .keras file with tfmetal_ext layers")
    p.add_argument("output", help="where to save the stock .keras file")
    p.add_argument("--batch", type=_positive_int, default=2, help="batch size of the verification inputs")
    p.add_argument("--no-verify", action="store_true",
                   help="skip verifying outputs and gradients, and loading the file without tfmetal_ext")
    p.set_defaults(func=_cmd_to_stock)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
