"""``medseg infer`` and ``medseg evaluate``: a trained run on new images, and scored on labelled ones."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _evaluate(args: argparse.Namespace) -> None:
    from medseg.inference.evaluate import (
        evaluate,
        evaluate_sites,
        format_result,
        format_sites,
        parse_data_args,
    )

    if args.data and len(args.data) > 1:
        result = evaluate_sites(
            args.run,
            parse_data_args(args.data),
            progress=not args.no_progress,
            trust=args.trust_bundle,
            infer=args.overrides,
        )
        print(f"{result['run']} on {len(result['sites'])} sites")
        print(format_sites(result))
        print(f"wrote {result['path']}")
        return
    named = parse_data_args(args.data)[0] if args.data else None
    result = evaluate(
        args.run,
        named[1] if named else None,
        progress=not args.no_progress,
        site=named[0] if named else None,
        trust=args.trust_bundle,
        infer=args.overrides,
    )
    print(f"{result['run']} on {result['data']}")
    print(format_result(result))
    print(f"summary: {json.dumps(result['summary'])}")
    print(f"wrote {result['path']}")


def _infer(args: argparse.Namespace) -> None:
    from medseg.datasets.checks import NIFTI_SUFFIXES, open_nifti

    if Path(args.input).is_file() and str(args.input).endswith(NIFTI_SUFFIXES):
        # header checks before torch and MONAI are even imported (seconds); whether the volume fits in
        # memory is checked once the path (streamed or loaded) is known
        open_nifti(args.input, memory=False)

    from medseg.inference.predict import infer_to_file

    out = infer_to_file(
        args.run,
        args.input,
        args.output,
        series_uid=args.series,
        resample=args.resample,
        stream_above=args.stream_above,
        trust=args.trust_bundle,
        infer=args.overrides,
    )
    print(f"wrote {out}")


def _add_trust(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--trust-bundle",
        action="store_true",
        help="build the bundle's network with MONAI's config parser, running any expression it holds; "
        "only for a bundle you made yourself (default: only medseg's networks, from literal arguments)",
    )


def _add_infer_overrides(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "overrides",
        nargs="*",
        metavar="infer.key=value",
        help="inference settings for this call, e.g. infer.mirror=[0,1,2] (test-time mirroring) "
        "infer.keep_largest=true",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``medseg evaluate`` and ``medseg infer``."""
    s = subparsers.add_parser("evaluate", help="score a trained run in original geometry")
    s.add_argument("--run", type=Path, required=True, help="run folder (runs/NAME) or bundle folder")
    s.add_argument(
        "--data",
        action="append",
        metavar="[SITE=]DIR",
        help="dataset folder to score every labelled case of (default: the run's validation split); "
        "repeat for several sites: a table of sites against metrics, with a pooled row",
    )
    s.add_argument("--no-progress", action="store_true")
    _add_trust(s)
    _add_infer_overrides(s)
    s.set_defaults(func=_evaluate)

    s = subparsers.add_parser("infer", help="run a trained model on a NIfTI file or DICOM series folder")
    s.add_argument("--run", type=Path, required=True, help="run folder (runs/NAME) or bundle folder")
    s.add_argument("--input", type=Path, required=True, help="NIfTI file, DICOM series folder or DICOM file")
    s.add_argument(
        "--output", type=Path, required=True, help="OUT.nii.gz (segmentation) or OUT.json (classification)"
    )
    s.add_argument("--series", help="SeriesInstanceUID when the folder holds several series")
    s.add_argument(
        "--resample", action="store_true", help="interpolate uneven DICOM slice spacing onto a regular grid"
    )
    s.add_argument(
        "--stream-above",
        type=int,
        metavar="VOXELS",
        help="read NIfTI inputs of more voxels than this slab by slab instead of loading them (same "
        "labels, less memory; default 134217728 = 512x512x512, or MEDSEG_STREAM_VOXELS; 0 streams always)",
    )
    _add_trust(s)
    _add_infer_overrides(s)
    s.set_defaults(func=_infer)
