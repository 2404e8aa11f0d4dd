"""``medseg data``: make synthetic datasets, convert between DICOM and NIfTI, check a dataset."""

from __future__ import annotations

import argparse
from pathlib import Path

from medseg.errors import ConfigError, MedsegError

# synth-seg's scanner options: name -> (type, help); each is left at the scanner's default unless given.
SCANNER_OPTIONS = {
    "scale": (float, "intensity scale: HU' = scale * HU * bias field + offset (default 1)"),
    "offset": (float, "intensity offset in HU (default 0)"),
    "noise": (float, "Gaussian noise sigma in HU (default 20)"),
    "bias": (float, "bias field amplitude in [0, 1): smooth multiplicative shading (default 0)"),
    "spacing": (float, "in-plane voxel size in mm (default 0.8)"),
    "z_factor": (int, "slice thickness as a multiple of the in-plane size (default 3)"),
    "orientation": (str, "stored axis codes, e.g. LPS (default), RAS, LAS, PSL"),
    "small": (float, "case mix: share of cases with fewer, smaller structures (default 0)"),
}


def _synth_seg(args: argparse.Namespace) -> None:
    from medseg.datasets.synthetic import make_seg_dataset, scanner_with

    changes = {k: getattr(args, k) for k in SCANNER_OPTIONS}
    scanner = scanner_with(None, **changes) if any(v is not None for v in changes.values()) else None
    out = make_seg_dataset(
        args.out,
        n_train=args.cases,
        n_test=args.test,
        seed=args.seed,
        size=args.size,
        scanner=scanner,
        modality=args.modality,
    )
    print(
        f"segmentation dataset ({args.modality.upper()}): {out} ({args.cases} training, {args.test} test cases)"
    )


def _synth_sites(args: argparse.Namespace) -> None:
    from medseg.datasets.synthetic import SITE_PRESETS, make_site_datasets

    made = make_site_datasets(args.out, args.preset, args.cases, args.test, args.seed, args.size)
    for site, dirs in made.items():
        print(f"site {site}: {dirs['train']}" + (f" (held out: {dirs['test']})" if "test" in dirs else ""))
        print(f"  scanner {SITE_PRESETS[args.preset][site]}")
    print("config:\nsites:")
    for site, dirs in made.items():
        print(f"  {site}: {{dir: {dirs['train']}}}")


def _split_sites(args: argparse.Namespace) -> None:
    from medseg.datasets.site_split import parse_counts, split_sites

    stored_as = None
    if args.stored_as:
        dtype, _, site = args.stored_as.partition("=")
        if not dtype or not site:
            raise ConfigError(f"--stored-as {args.stored_as!r}: expected DTYPE=SITE, e.g. uint8=c")
        stored_as = (dtype, site)
    made = split_sites(args.data, args.out, parse_counts(args.sites), args.test, stored_as, args.seed)
    for site, dirs in made.items():
        print(f"site {site}: {dirs['train']} (held out: {dirs['test']})")
    print("config:\nsites:")
    for site, dirs in made.items():
        print(f"  {site}: {{dir: {dirs['train']}}}")


def _synth_cls(args: argparse.Namespace) -> None:
    from medseg.datasets.synthetic import make_cls_dataset

    out = make_cls_dataset(args.out, n_train=args.cases, n_test=args.test, seed=args.seed)
    print(f"classification dataset: {out} ({args.cases} training, {args.test} test cases)")


def _convert(args: argparse.Namespace) -> None:
    from medseg.datasets.dicom.convert import dicom_to_nifti

    out = dicom_to_nifti(args.dicom_dir, args.output, series_uid=args.series, resample=args.resample)
    print(f"wrote {out}")


def _to_dicom(args: argparse.Namespace) -> None:
    from medseg.datasets.checks import NIFTI_SUFFIXES, open_nifti, prepare_output_dir

    prepare_output_dir(args.out_dir, [args.nifti], create=False)
    if Path(args.nifti).is_file() and str(args.nifti).endswith(NIFTI_SUFFIXES):
        open_nifti(args.nifti)  # header checks before torch and MONAI are even imported (seconds)

    from medseg.datasets.dicom.write import write_dicom_series
    from medseg.inference.io import load_image

    image = load_image(args.nifti)
    if image.shape[0] != 1:
        raise MedsegError(f"{args.nifti}: has {image.shape[0]} channels; a DICOM series holds one")
    files = write_dicom_series(
        image[0].numpy(),
        image.affine.numpy(),
        args.out_dir,
        series_description=args.description,
        overwrite=args.overwrite,
    )
    print(f"wrote {len(files)} slices to {args.out_dir}")


def _validate(args: argparse.Namespace) -> None:
    from medseg.datasets.validate import validate_dataset

    report = validate_dataset(args.dataset_dir)
    print(report.format_table())
    if not report.ok:
        raise MedsegError(f"{args.dataset_dir}: {len(report.problems)} problem(s) found, listed above")


def _add_synth_parsers(data: argparse._SubParsersAction) -> None:
    """synth-seg, synth-cls and synth-sites."""
    for name, fn, cases, helptext in (
        ("synth-seg", _synth_seg, 16, "synthetic CT segmentation dataset (Decathlon layout)"),
        ("synth-cls", _synth_cls, 160, "synthetic shape classification dataset"),
    ):
        s = data.add_parser(name, help=helptext)
        s.add_argument("--out", type=Path, required=True, help="dataset folder to write")
        s.add_argument("--cases", type=int, default=cases, help="training cases")
        s.add_argument("--test", type=int, default=2, help="unlabelled test cases")
        s.add_argument("--seed", type=int, default=0)
        if name == "synth-seg":
            s.add_argument(
                "--modality",
                choices=["ct", "mr"],
                default="ct",
                help="ct: Hounsfield units; mr: no unit, arbitrary scale per case, bias field, Rician noise",
            )
        s.set_defaults(func=fn)
        if name == "synth-seg":
            s.add_argument("--size", type=int, default=96, help="voxels per side before slice thinning")
            for opt, (tp, helptext) in SCANNER_OPTIONS.items():
                s.add_argument(f"--{opt.replace('_', '-')}", dest=opt, type=tp, help=helptext)
    s = data.add_parser(
        "synth-sites", help="synthetic hospitals with unlike scanners (a preset), one dataset each"
    )
    s.add_argument("--out", type=Path, required=True, help="folder for <site>/ and <site>-test/")
    s.add_argument("--preset", default="3-sites", help="which hospitals (default 3-sites)")
    s.add_argument("--cases", type=int, default=12, help="training cases per site")
    s.add_argument("--test", type=int, default=6, help="labelled held-out cases per site (<site>-test)")
    s.add_argument("--size", type=int, default=96, help="voxels per side before slice thinning")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_synth_sites)
    s = data.add_parser(
        "split-sites", help="deal a labelled dataset to unlike sites (<site>/ and held-out <site>-test/)"
    )
    s.add_argument("--data", type=Path, required=True, help="a dataset folder in the Decathlon layout")
    s.add_argument("--out", type=Path, required=True, help="folder for <site>/, <site>-test/ and split.json")
    s.add_argument("--sites", required=True, help="cases per site, held-out ones included: a=90,b=60,c=50")
    s.add_argument("--test", type=int, default=10, help="labelled held-out cases per site (default 10)")
    s.add_argument("--stored-as", help="DTYPE=SITE: every image stored as DTYPE goes to SITE (e.g. uint8=c)")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_split_sites)


def _add_file_parsers(data: argparse._SubParsersAction) -> None:
    """convert, to-dicom and validate."""
    s = data.add_parser(
        "convert", help="DICOM series folder or multi-frame DICOM file -> NIfTI, geometry preserved"
    )
    s.add_argument(
        "dicom_dir", type=Path, help="DICOM series folder, or one (Enhanced multi-frame) DICOM file"
    )
    s.add_argument("output", type=Path)
    s.add_argument("--series", help="SeriesInstanceUID to read when the folder holds several series")
    s.add_argument(
        "--resample", action="store_true", help="interpolate uneven slice spacing onto a regular grid"
    )
    s.set_defaults(func=_convert)
    s = data.add_parser("to-dicom", help="NIfTI volume -> CT DICOM series folder (one file per slice)")
    s.add_argument("nifti", type=Path)
    s.add_argument("out_dir", type=Path)
    s.add_argument("--description", default="medseg", help="SeriesDescription")
    s.add_argument("--overwrite", action="store_true", help="replace a series already in out_dir")
    s.set_defaults(func=_to_dicom)
    s = data.add_parser("validate", help="check every case of a dataset; exit 2 naming each problem")
    s.add_argument("dataset_dir", type=Path)
    s.set_defaults(func=_validate)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """``medseg data`` and its subcommands."""
    data = subparsers.add_parser("data", help="make, convert and check datasets").add_subparsers(
        dest="data_command", required=True
    )
    _add_synth_parsers(data)
    _add_file_parsers(data)
