"""The ``medseg`` command line.

Every subcommand calls one library function. A :class:`medseg.errors.MedsegError` is printed as
``error: <message>`` without a traceback and exits with status 2 (as do usage errors).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from medseg.errors import ConfigError, MedsegError

log = logging.getLogger("medseg")


def _data_synth_seg(args: argparse.Namespace) -> None:
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


def _data_synth_sites(args: argparse.Namespace) -> None:
    from medseg.datasets.synthetic import SITE_PRESETS, make_site_datasets

    made = make_site_datasets(args.out, args.preset, args.cases, args.test, args.seed, args.size)
    for site, dirs in made.items():
        print(f"site {site}: {dirs['train']}" + (f" (held out: {dirs['test']})" if "test" in dirs else ""))
        print(f"  scanner {SITE_PRESETS[args.preset][site]}")
    print("config:\nsites:")
    for site, dirs in made.items():
        print(f"  {site}: {{dir: {dirs['train']}}}")


def _data_synth_cls(args: argparse.Namespace) -> None:
    from medseg.datasets.synthetic import make_cls_dataset

    out = make_cls_dataset(args.out, n_train=args.cases, n_test=args.test, seed=args.seed)
    print(f"classification dataset: {out} ({args.cases} training, {args.test} test cases)")


def _data_convert(args: argparse.Namespace) -> None:
    from medseg.datasets.dicom.reader import dicom_to_nifti

    out = dicom_to_nifti(args.dicom_dir, args.output, series_uid=args.series, resample=args.resample)
    print(f"wrote {out}")


def _data_to_dicom(args: argparse.Namespace) -> None:
    from medseg.datasets.checks import NIFTI_SUFFIXES, open_nifti, prepare_output_dir

    prepare_output_dir(args.out_dir, [args.nifti], create=False)
    if Path(args.nifti).is_file() and str(args.nifti).endswith(NIFTI_SUFFIXES):
        open_nifti(args.nifti)  # header checks before torch and MONAI are even imported (seconds)

    from medseg.datasets.dicom.reader import write_dicom_series
    from medseg.inference.predict import load_image

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


def _data_validate(args: argparse.Namespace) -> None:
    from medseg.datasets.validate import validate_dataset

    report = validate_dataset(args.dataset_dir)
    print(report.format_table())
    if not report.ok:
        raise MedsegError(f"{args.dataset_dir}: {len(report.problems)} problem(s) found, listed above")


def _train(args: argparse.Namespace) -> None:
    from medseg.config import load_config
    from medseg.distributed.launch.launcher import end_rank, is_worker, launch, skip_unused_imports

    if is_worker():
        skip_unused_imports()  # before anything imports MONAI
    cfg = load_config(args.config, args.overrides)
    if args.np is not None and not is_worker():
        launch(
            cfg,
            args.config,
            args.overrides,
            args.np,
            args.hosts,
            args.resume,
            max_restarts=args.max_restarts,
            min_sites=args.min_sites,
        )
        _print_run(cfg.run_dir)
        return
    from medseg.distributed.testbed.emulate import install_from_env
    from medseg.training.loop import train  # not before: the launcher itself never trains

    install_from_env()  # test-only emulation (a straggler, slow phases): the one seam, a no-op unless asked
    result = train(cfg, resume=args.resume, progress=not args.no_progress)
    if is_worker():
        end_rank()  # the launcher reports for the whole job
    best = (
        f"{result.best_metric:.4f} at epoch {result.best_epoch}" if result.best_metric is not None else "n/a"
    )
    print(
        f"run {result.run_dir}: {result.epochs} epochs, best {result.key_metric} {best}; bundle in {result.run_dir / 'bundle'}"
    )


def _print_run(run_dir: Path) -> None:
    from medseg.training.runlog import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    if records:
        last = records[-1]
        shown = ", ".join(f"{k}={v:.4g}" for k, v in last.items() if isinstance(v, float))
        print(f"run {run_dir}: {last['epoch']} epochs; last epoch {shown}; bundle in {run_dir / 'bundle'}")


def _evaluate(args: argparse.Namespace) -> None:
    from medseg.inference.evaluate import (
        evaluate,
        evaluate_sites,
        format_result,
        format_sites,
        parse_data_args,
    )

    if args.data and len(args.data) > 1:
        result = evaluate_sites(args.run, parse_data_args(args.data), progress=not args.no_progress)
        print(f"{result['run']} on {len(result['sites'])} sites")
        print(format_sites(result))
        print(f"wrote {result['path']}")
        return
    named = parse_data_args(args.data)[0] if args.data else None
    result = evaluate(
        args.run, named[1] if named else None, progress=not args.no_progress, site=named[0] if named else None
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
    )
    print(f"wrote {out}")


def _plan(args: argparse.Namespace) -> None:
    from medseg.planning.planner import format_verify, plan, verify, write_plan

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available() and (args.verify or args.memory_gb is None):
            raise ConfigError(
                "--device cuda: torch sees no CUDA device here, and the memory model is measured on the "
                "device; plan on the GPU machine, or use --device cpu"
            )
    p = plan(
        args.dataset,
        memory_gb=args.memory_gb,
        device=args.device,
        fused=args.fused,
        net=args.net,
        time_s=-1.0 if args.time_s is None else args.time_s,
        steps=args.steps,
        name=args.name,
        refresh=args.refresh,
    )
    if args.verify:
        print(format_verify(verify(p)))
    out = write_plan(p, args.out)
    cfg = p.config
    print(
        f"plan: {cfg['model']['name']}, spacing {cfg['transforms']['spacing']} mm, patch {cfg['transforms']['patch']}, "
        f"batch {cfg['train']['batch_size']} case(s) x {cfg['transforms']['num_samples']} patches, "
        f"{cfg['train']['epochs']} epochs, "
        f"normalisation {cfg['transforms']['normalize']['scheme']}"
    )
    if args.json:
        doc = {
            "config": cfg,
            "comments": p.comments,
            "predicted_total_bytes": p.predicted_total,
            "predicted_step_peak_bytes": p.predicted_step_peak,
            "predicted_step_s": p.predicted_step_s,
            "budget_bytes": p.budget_bytes,
            "params": p.params,
            "verify": p.verify,
            "probes": [vars(pr) for pr in p.memory.probes] if p.memory else None,
            "topology": p.memory.topology if p.memory else None,
            "probe_runs": p.probe_runs,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}; train with: medseg train --config {out}")


def _app(args: argparse.Namespace) -> None:
    from medseg.apps.launch import serve

    serve(args.runs or [Path("runs")], args.port)


def _report(result: dict, args: argparse.Namespace, write_report, format_table, check_targets) -> None:
    """Every benchmark's ending: JSON (and markdown section) written, table and target checks printed."""
    write_report(result, args.json, args.markdown)
    print(format_table(result))
    for name, ok in check_targets(result):
        print(f"{'met   ' if ok else 'MISSED'} {name}")
    print(f"wrote {args.json}" + (f" and {args.markdown}" if args.markdown else ""))


def _read_json(path: Path, what: str) -> dict:
    import json

    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{what}: {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{what}: {path} is not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {path} holds no benchmark result (not a JSON object)")
    return data


def _bench_sites(args: argparse.Namespace) -> None:
    from medseg.bench.sites import bench_sites, check_targets, format_table, write_report

    result = bench_sites(
        args.workdir,
        quick=args.quick,
        seeds=args.seeds,
        epochs=args.epochs,
        scenarios=args.scenarios.split(",") if args.scenarios else None,
        configs=args.configs.split(",") if args.configs else None,
        reuse=_read_json(args.reuse, "--reuse") if args.reuse else None,
    )
    _report(result, args, write_report, format_table, check_targets)


def _bench_memory(args: argparse.Namespace) -> None:
    import torch

    from medseg.bench.memory import bench_memory, check_targets, format_table, write_report

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here; use --device cpu")
    result = bench_memory(
        quick=args.quick,
        device=args.device,
        nets=tuple(args.nets),
        budget_gb=args.budget_gb,
        verify=args.verify,
        variants=tuple(args.variants) if args.variants else None,
        steps=args.steps,
    )
    _report(result, args, write_report, format_table, check_targets)


def _sites(args: argparse.Namespace) -> None:
    from medseg.distributed.testbed.testbed import Testbed

    if args.sites_command == "up":
        tb = Testbed.up(args.sites, args.wan, args.cpu, probe=False, lifetime_s=args.lifetime, owned=False)
        if not args.no_probe:
            try:
                report = tb.probe(check=True)
            except MedsegError:
                tb.down()
                raise
            print(json.dumps(report, indent=1))
        print(json.dumps(tb.status(), indent=1))
        print(
            f"testbed up: medseg train --config C --np {sum(s.ranks for s in tb.sites)} --hosts {tb.hosts_arg()}"
        )
        print(
            f"with PATH={tb.bin_dir}:$PATH MEDSEG_HOROVODRUN_ARGS='{tb.launcher_env()['MEDSEG_HOROVODRUN_ARGS']}'"
        )
    elif args.sites_command == "status":
        print(json.dumps(Testbed.current().status(), indent=1))
    elif args.sites_command == "probe":
        report = Testbed.current().probe(check=not args.report_only, seconds=args.seconds)
        print(json.dumps(report, indent=1))
    else:
        from medseg.distributed.testbed.testbed import down

        removed = down()
        print("removed: " + ("; ".join(removed) if removed else "nothing"))


def _bench_infer(args: argparse.Namespace) -> None:
    import torch

    from medseg.bench.infer import bench_infer, check_targets, format_table, write_report

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here; use --device cpu")
    kwargs = {}
    if args.sizes:
        sizes = []
        for text in args.sizes:
            parts = text.lower().split("x")
            if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ConfigError(
                    f"--sizes {text}: give sizes as IxJxK with positive whole numbers, e.g. 512x512x300"
                )
            sizes.append(tuple(int(n) for n in parts))
        kwargs["sizes"] = sizes
    if args.classes:
        kwargs["classes"] = tuple(args.classes)
    if args.variants:
        kwargs["variants"] = tuple(args.variants)
    if args.old_limit_gb is not None:
        kwargs["old_limit_bytes"] = int(args.old_limit_gb * 2**30)
    if args.reuse_log is not None:
        from medseg.bench.infer import runs_from_log

        if not args.reuse_log.is_file():
            raise ConfigError(
                f"--reuse-log {args.reuse_log}: no such file; give the log an earlier run printed to"
            )
        kwargs["reuse"] = runs_from_log(args.reuse_log.read_text())
        if not kwargs["reuse"]:
            raise ConfigError(
                f"--reuse-log {args.reuse_log}: holds no finished runs (lines 'IxJxK classes variant {{json}}')"
            )
    result = bench_infer(
        args.workdir, quick=args.quick, device=args.device, rounds=args.rounds, partial=args.json, **kwargs
    )
    _report(result, args, write_report, format_table, check_targets)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="medseg", description="MONAI 3D segmentation and classification: data, training, inference."
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    data = sub.add_parser("data", help="make, convert and check datasets").add_subparsers(
        dest="data_command", required=True
    )
    for name, fn, cases, helptext in (
        ("synth-seg", _data_synth_seg, 16, "synthetic CT segmentation dataset (Decathlon layout)"),
        ("synth-cls", _data_synth_cls, 160, "synthetic shape classification dataset"),
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
    s.set_defaults(func=_data_synth_sites)
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
    s.set_defaults(func=_data_convert)
    s = data.add_parser("to-dicom", help="NIfTI volume -> CT DICOM series folder (one file per slice)")
    s.add_argument("nifti", type=Path)
    s.add_argument("out_dir", type=Path)
    s.add_argument("--description", default="medseg", help="SeriesDescription")
    s.add_argument("--overwrite", action="store_true", help="replace a series already in out_dir")
    s.set_defaults(func=_data_to_dicom)
    s = data.add_parser("validate", help="check every case of a dataset; exit 2 naming each problem")
    s.add_argument("dataset_dir", type=Path)
    s.set_defaults(func=_data_validate)

    s = sub.add_parser("train", help="train a model from a YAML config")
    s.add_argument("--config", type=Path, required=True)
    s.add_argument(
        "--resume", action="store_true", help="continue the run named by the config from its last checkpoint"
    )
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument(
        "--np", type=int, help="train on N ranks under horovodrun (needs dist.sync other than none)"
    )
    s.add_argument("--hosts", help="HOST:SLOTS,... for --np across servers (default localhost:N)")
    s.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="with --np: when a site's ranks die or its link is cut, restart from the last checkpoint "
        "without that site, up to N times (default 0: stop)",
    )
    s.add_argument(
        "--min-sites", type=int, default=1, help="with --max-restarts: stop (exit 2) below this many sites"
    )
    s.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. train.epochs=5")
    s.set_defaults(func=_train)

    s = sub.add_parser(
        "plan",
        help="fingerprint a dataset and write a config fitted to it and to a memory (and time) budget",
    )
    s.add_argument("dataset", type=Path, help="dataset folder (dataset.json, Decathlon layout)")
    s.add_argument("--out", type=Path, required=True, help="config YAML to write, e.g. configs/NAME.yaml")
    s.add_argument(
        "--memory-gb",
        type=float,
        help="memory budget of a training step (default: half the free RAM up to 8, or 90%% of the GPU)",
    )
    s.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="where it will train (and is measured)"
    )
    s.add_argument(
        "--fused", action="store_true", help="plan for train.memory=fused (measured with the fused kernels)"
    )
    s.add_argument(
        "--net", choices=["unet", "segresnet", "dynunet"], help="default: unet on cpu, dynunet on cuda"
    )
    s.add_argument(
        "--time-s",
        type=float,
        help="wall seconds of training steps the plan must fit (default on cpu: the demo's compute, measured as an anchor in the same run; 0 = no limit; cuda: none)",
    )
    s.add_argument(
        "--steps", type=int, help="training steps to plan for (default 1000 on cpu, 25000 on cuda)"
    )
    s.add_argument("--name", help="run name (default plan-<dataset folder>)")
    s.add_argument(
        "--verify",
        action="store_true",
        help="train two steps at the plan and report measured peak vs predicted",
    )
    s.add_argument(
        "--json", type=Path, help="also write the plan, its predictions and --verify's result here"
    )
    s.add_argument(
        "--refresh", action="store_true", help="read the dataset again instead of the cached fingerprint"
    )
    s.set_defaults(func=_plan)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    s = bench.add_parser(
        "sites", help="sync modes between emulated hospitals (network namespaces, shaped WAN), root only"
    )
    s.add_argument("--quick", action="store_true", help="20 Mbit/s and no-WAN scenarios, 4 configs, 1 seed")
    s.add_argument("--json", type=Path, required=True, help="write the results here")
    s.add_argument("--markdown", type=Path, help="update this markdown file's sites section")
    s.add_argument("--seeds", type=int, help="seeds per config (default 3, --quick 1)")
    s.add_argument("--epochs", type=int, help="epochs per run (default 8, --quick 4)")
    s.add_argument("--scenarios", help="comma-separated subset of lan,wan100,wan20")
    s.add_argument(
        "--configs", help="comma-separated subset of bsp-none,bsp-fp16,bsp-fixed4,local-sgd,gssp,gssp-fixed4"
    )
    s.add_argument(
        "--workdir", type=Path, default=Path("runs/bench-sites"), help="data and runs of the benchmark"
    )
    s.add_argument(
        "--reuse",
        type=Path,
        help="an earlier --json of the same seeds and epochs: its scenario/config results are kept, not re-run",
    )
    s.set_defaults(func=_bench_sites)
    s = bench.add_parser(
        "memory", help="fused kernels vs baseline, checkpointing and torch.compile: memory and time"
    )
    s.add_argument(
        "--quick", action="store_true", help="64^3 patches, no torch.compile variant (a few minutes)"
    )
    s.add_argument("--json", type=Path, default=Path("bench-memory.json"), help="write results here")
    s.add_argument("--markdown", type=Path, help="update this markdown file's memory section")
    s.add_argument("--device", default="cpu", help="cpu or cuda")
    s.add_argument(
        "--nets",
        nargs="+",
        default=["unet", "segresnet", "dynunet", "unet-14cls"],
        choices=["unet", "segresnet", "dynunet", "unet-14cls"],
        help="cases; unet-14cls: UNet at the default width with 14 classes",
    )
    s.add_argument(
        "--variants",
        nargs="+",
        choices=["baseline", "fused", "checkpoint", "compile"],
        help="default: all four (--quick: all but compile)",
    )
    s.add_argument(
        "--budget-gb",
        type=float,
        help="memory budget for the largest patch (default 1 GiB with --quick, else 8)",
    )
    s.add_argument(
        "--verify", action="store_true", help="measure each variant at its predicted largest patch"
    )
    s.add_argument("--steps", type=int, default=5, help="timed steps per variant (median reported)")
    s.set_defaults(func=_bench_memory)

    sites = sub.add_parser(
        "sites",
        help="emulated hospital network on this machine (root): namespaces, shaped WAN, sshd per site",
    ).add_subparsers(dest="sites_command", required=True)
    s = sites.add_parser("up", help="make the testbed (replacing a crashed one) and probe its WAN")
    s.add_argument("--sites", required=True, help="NAME:RANKS,... e.g. a:2,b:2")
    s.add_argument(
        "--wan", default="none", help="RATE:DELAY[:LOSS] between sites, e.g. 20mbit:25ms:0.1%%, or none"
    )
    s.add_argument("--cpu", help="SITE=CORES per rank, e.g. a=0.5,b=0.25 (cgroup CPU quota; optional)")
    s.add_argument("--no-probe", action="store_true", help="skip the RTT and throughput check")
    s.add_argument("--lifetime", type=float, default=4 * 3600, help="seconds the WAN relay lives at most")
    s.set_defaults(func=_sites)
    s = sites.add_parser("status", help="print the testbed's sites, WAN and processes as JSON")
    s.set_defaults(func=_sites)
    s = sites.add_parser("probe", help="measure RTT and throughput between two sites against the spec")
    s.add_argument("--report-only", action="store_true", help="print the report; exit 0 even when off spec")
    s.add_argument("--seconds", type=float, default=3.0, help="length of the throughput flow")
    s.set_defaults(func=_sites)
    s = sites.add_parser(
        "down",
        help="remove every namespace, link, cgroup, process and file of the testbed (also half-made ones)",
    )
    s.set_defaults(func=_sites)

    s = bench.add_parser(
        "infer", help="predict's memory and time vs the previous path, synthetic CTs up to 512x512x1000"
    )
    s.add_argument("--quick", action="store_true", help="small volumes, one round (a minute or two)")
    s.add_argument("--json", type=Path, required=True, help="write the results here")
    s.add_argument("--markdown", type=Path, help="update this markdown file's infer section")
    s.add_argument("--device", default="cpu", help="cpu or cuda")
    s.add_argument("--rounds", type=int, default=2, help="timed rounds of old and new per case (default 2)")
    s.add_argument("--sizes", nargs="+", metavar="IxJxK", help="input sizes (default: all three CT sizes)")
    s.add_argument("--classes", type=int, nargs="+", help="class counts (default: 3 14)")
    s.add_argument(
        "--variants",
        nargs="+",
        choices=["old", "new", "new-stream", "new-fp16"],
        help="variants to run (default: all; old only where it fits, new-fp16 only at 256x256x128 and --quick)",
    )
    s.add_argument(
        "--old-limit-gb",
        type=float,
        help="run the previous path only where its predicted peak is below this (default 14)",
    )
    s.add_argument(
        "--reuse-log",
        type=Path,
        help="take the runs an interrupted invocation printed to this log (its label maps must be in --workdir)",
    )
    s.add_argument(
        "--workdir",
        type=Path,
        default=Path("runs/bench-infer"),
        help="bundles and label maps of the benchmark",
    )
    s.set_defaults(func=_bench_infer)

    s = sub.add_parser("app", help="start the Streamlit viewer on localhost")
    s.add_argument(
        "--runs",
        type=Path,
        action="append",
        help="folder of runs to list models from (default runs; repeatable)",
    )
    s.add_argument("--port", type=int, default=8501, help="port on localhost (default 8501)")
    s.set_defaults(func=_app)

    s = sub.add_parser("evaluate", help="score a trained run in original geometry")
    s.add_argument("--run", type=Path, required=True, help="run folder (runs/NAME) or bundle folder")
    s.add_argument(
        "--data",
        action="append",
        metavar="[SITE=]DIR",
        help="dataset folder to score every labelled case of (default: the run's validation split); "
        "repeat for several sites: a table of sites against metrics, with a pooled row",
    )
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=_evaluate)

    s = sub.add_parser("infer", help="run a trained model on a NIfTI file or DICOM series folder")
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
    s.set_defaults(func=_infer)
    return p


class _OwnMessages(logging.Filter):
    """Keep third-party warnings (MONAI's nvImageCodec notices, deprecations) off the user's terminal.

    medseg's own records and any ERROR pass; the rest are shown with ``-v``.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("medseg") or record.levelno >= logging.ERROR


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    if not args.verbose:
        handler.addFilter(_OwnMessages())
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, handlers=[handler])
    logging.captureWarnings(True)  # warnings.warn from libraries becomes a 'py.warnings' log record
    for noisy in ("monai", "matplotlib", "PIL"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        args.func(args)
    except MedsegError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
