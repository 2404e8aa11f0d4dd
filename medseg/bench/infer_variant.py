"""One variant of ``medseg bench infer``, measured in this process: ``python -m medseg.bench.infer_variant``.

The input is made (or, for ``new-stream``, opened lazily), then the allocator is trimmed and the
high-water mark reset (``5 > /proc/self/clear_refs``), so that ``peak_bytes`` (``VmHWM``) is the
whole process's peak during the ``predict`` call: libraries, the input and the prediction. Prints
one JSON line; with ``--labels-out`` saves the labels (and for ``old`` its top-two margins).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import numpy as np
import torch

from medseg.bench.infer_cases import synthetic_ct
from medseg.bench.infer_reference import predict_reference, top2_margin
from medseg.kernels.measure import malloc_trim, status_kb

#: Every variant; ``new-stream`` and ``new-fp16`` run one round per case.
VARIANTS = ("old", "new", "new-stream", "new-fp16")


def measure_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.variant`` once on its input; its time, peaks and memory estimate (see module docstring)."""
    from medseg.bundle.load import load_bundle
    from medseg.inference import memory
    from medseg.inference import segment as segmentation
    from medseg.inference.io import load_image
    from medseg.inference.predict import predict

    torch.set_num_threads(args.threads or torch.get_num_threads())
    bundle = load_bundle(args.bundle)
    stream = args.variant == "new-stream"
    if stream:  # the file, read by the streaming path inside the measured call
        image = load_image(args.nifti, stream_above=0)
    else:
        image = synthetic_ct(tuple(args.shape), seed=args.seed)
    est = memory.estimate(bundle.config, image, len(bundle.labels))
    gc.collect()
    malloc_trim()
    before_kb = status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        gpu0 = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    probs = None
    if args.variant == "old":
        label, probs = predict_reference(bundle, image, device=args.device, keep_probs=True)
    else:
        if args.variant == "new-fp16":
            segmentation.ACCUMULATE_DTYPE = torch.float16
        label = predict(bundle, image, device=args.device).label[0].as_tensor()
    seconds = time.perf_counter() - t0
    peak_kb = status_kb("VmHWM")  # before anything below allocates
    out = {
        "seconds": round(seconds, 2),
        "peak_bytes": peak_kb * 1024,
        "before_bytes": before_kb * 1024,
        "input_bytes": int(image.numel() * (4 if stream else image.element_size())),
        "predicted_peak_bytes": est.peak_bytes,
        "threads": torch.get_num_threads(),
    }
    if cuda:
        out["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated() - gpu0)
    if args.labels_out:
        np.save(args.labels_out, label.numpy())
        if probs is not None:  # old's top-two margins, to judge where labels may differ (TIE_TOLERANCE)
            np.save(args.labels_out.replace(".npy", "-margin.npy"), top2_margin(probs).numpy())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="one variant of medseg bench infer (internal)")
    p.add_argument("--bundle", required=True)
    p.add_argument("--variant", choices=list(VARIANTS), required=True)
    p.add_argument("--nifti", help="the input as a file (new-stream)")
    p.add_argument("--shape", type=int, nargs=3, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--labels-out")
    print(json.dumps(measure_variant(p.parse_args())))


if __name__ == "__main__":
    main()
