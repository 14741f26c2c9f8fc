"""Image-text benchmark: images/s and texts/s of a CLIP of ViT-B/32 size served by us and by
infinity-emb (its `/embeddings_image`), against an in-process transformers loop on the same
folder, in one run.

No CLIP weights are available offline, so the model is built once from transformers'
default `CLIPConfig` (ViT-B/32: a 12-layer 768-wide vision tower on 224x224 images in
32x32 patches, a 12-layer 512-wide text tower, projections to 512) with random weights,
over the packaged all-MiniLM-L6-v2 WordPiece tokenizer (its [SEP] the text tower's
end-of-text token), with CLIP's image processor, in ``~/.cache/infinity-bench/clip-vit-b32``.
Speed does not depend on the values.

Workload: 64 distinct 320x240 JPEG photographs' worth of noise (about 70 KB each, as data:
URIs), and captions: corpus sentences cut to 12 words. The ceiling child decodes the same JPEG bytes with Pillow,
runs the processor and `get_image_features` / `get_text_features` in batches of 32 (2 torch
threads). Each server gets closed-loop loads of ITEMSxCONCURRENCY.

Usage:
    .venv/bin/python -m bench.images [--peer] [--engines auto,torch]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench import cpu
from bench.corpus import sentences
from bench.loadgen import closed_loop
from bench.run import (_INFINITY_ENV, ConfiguredServer, INFINITY_EMB, OUT_DIR, REPO, add_measurement_args, free_port,
                       least_disturbed, measure_child, parse_pairs, start_run, stop_server, wait_healthy, wait_quiet)

MODEL_DIR = Path.home() / ".cache" / "infinity-bench" / "clip-vit-b32"
MODEL_NAME = "clip"
BATCH = 32
CAPTION_WORDS = 12
_BUILT_MARKER = ".bench-built"


def build_model() -> Path:
    if (MODEL_DIR / _BUILT_MARKER).is_file():
        return MODEL_DIR
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, PreTrainedTokenizerFast

    from infinity.models import packaged_model_folder

    from tokenizers import Tokenizer

    wordpiece = Tokenizer.from_file(str(packaged_model_folder() / "tokenizer.json"))
    wordpiece.no_padding()  # the packaged file pads every text to 128
    wordpiece.no_truncation()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                        model_max_length=77)
    config = CLIPConfig(text_config={"eos_token_id": tokenizer.sep_token_id, "bos_token_id": tokenizer.cls_token_id,
                                     "pad_token_id": tokenizer.pad_token_id})
    torch.manual_seed(0)
    staging = MODEL_DIR.with_name(f"{MODEL_DIR.name}.tmp-{os.getpid()}")
    CLIPModel(config).eval().save_pretrained(staging)
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer).save_pretrained(staging)
    (staging / _BUILT_MARKER).write_text("CLIPConfig() with random weights, seed 0\n")
    os.replace(staging, MODEL_DIR)
    return MODEL_DIR


def photos(count: int = 64) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)).save(buffer, "JPEG", quality=85)
        out.append(buffer.getvalue())
    return out


def captions(count: int = 4096) -> list[str]:
    """Texts as CLIP is asked: corpus sentences cut to their first 12 words (about 15
    tokens, under the 20 that infinity cuts every CLIP text to, so both servers do the
    same work)."""
    return [" ".join(text.split()[:CAPTION_WORDS]) for text in sentences(count, 0)]


def data_uri(data: bytes) -> str:
    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


# --- the ceiling child ------------------------------------------------------------------


def ceiling(threads: int, duration: float) -> dict[str, float]:
    """Images/s and texts/s of the in-process loop, batches of `BATCH`."""
    import torch
    from PIL import Image
    from transformers import AutoModel, AutoProcessor

    torch.set_num_threads(threads)
    model, processor = AutoModel.from_pretrained(str(MODEL_DIR)).eval(), AutoProcessor.from_pretrained(str(MODEL_DIR))
    files, texts = photos(), captions()

    def images(batch: list[bytes]) -> None:
        decoded = [Image.open(io.BytesIO(data)).convert("RGB") for data in batch]
        with torch.inference_mode():
            model.get_image_features(**processor(images=decoded, return_tensors="pt"))

    def text(batch: list[str]) -> None:
        with torch.inference_mode():
            model.get_text_features(**processor(text=batch, padding=True, truncation=True, return_tensors="pt"))

    result = {}
    for name, run, items in (("images", images, files), ("texts", text, texts)):
        run(items[:BATCH])  # one-time costs
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration:
            run([items[(done + i) % len(items)] for i in range(BATCH)])
            done += BATCH
        result[f"{name}_per_s"] = done / (time.perf_counter() - start)
    return result


# --- servers ---------------------------------------------------------------------------


def load(args: argparse.Namespace, url: str, route: str, modality: str, items: int, concurrency: int,
         pgid: int) -> dict[str, float]:
    others_before = wait_quiet(args, pgid)
    uris, texts, position = [data_uri(data) for data in photos()], captions(), [0]
    pool = uris if modality == "image" else texts

    def check(payload: object) -> None:
        if not isinstance(payload, dict) or len(payload.get("data", [])) != items:
            raise ValueError(f"expected {items} items")

    def next_request() -> tuple[dict[str, object], object]:
        start = position[0]
        position[0] = (start + items) % len(pool)
        body = {"model": MODEL_NAME, "input": [pool[(start + i) % len(pool)] for i in range(items)]}
        if modality == "image" and route == "/embeddings":
            body["modality"] = "image"
        return body, check

    before, by_process = cpu.sample(pgid), cpu.ticks_by_name(pgid)
    window = asyncio.run(closed_loop(url, route, next_request, concurrency=concurrency, duration=args.duration,
                                     warmup=args.warmup, timeout=300.0))
    return {"modality": modality, "items": items, "concurrency": concurrency,
            "per_s": window.good * items / args.duration, "p50_ms": window.percentile(50),
            "errors": window.errors, "first_error": window.first_error, "others_before": others_before,
            "others_during": cpu.other_share(before, cpu.sample(pgid)),
            "server_cpu_by_process": cpu.shares_by_name(by_process, cpu.ticks_by_name(pgid))}


def bench_loads(args: argparse.Namespace, name: str, url: str, image_route: str, pgid: int,
                ceil: dict[str, float]) -> list[dict[str, float]]:
    rows = []
    for modality, loads in (("image", args.image_loads), ("text", args.text_loads)):
        route = image_route if modality == "image" else "/embeddings"
        for items, concurrency in parse_pairs(loads):
            row = least_disturbed(args, lambda: load(args, url, route, modality, items, concurrency, pgid),
                                  lambda r: r["others_during"])
            row["server"] = name
            rows.append(row)
            ratio = row["per_s"] / ceil[f"{modality}s_per_s"]
            print(f"  {name}: {items} {modality}s x c{concurrency}: {row['per_s']:.1f}/s ({ratio:.2f} of the "
                  f"in-process loop), p50 {row['p50_ms']:.0f} ms, errors {row['errors']}"
                  + (f" ({row['first_error']})" if row["first_error"] else "")
                  + f", others' CPU {row['others_during']:.0%}", flush=True)
            print(f"    the server's CPU time by process: {row['server_cpu_by_process']}", flush=True)
    return rows


def bench_peer(args: argparse.Namespace, ceil: dict[str, float], stamp: str) -> list[dict[str, float]]:
    """infinity-emb 0.0.78 serving a copy of the folder whose tokenizer_config names a class
    transformers 4 knows (transformers 5 writes `TokenizersBackend`)."""
    folder = MODEL_DIR.with_name(MODEL_DIR.name + "-for-infinity")
    if not folder.is_dir():
        subprocess.run(["cp", "-r", str(MODEL_DIR), str(folder)], check=True)
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**settings,
                                                                  "tokenizer_class": "PreTrainedTokenizerFast"}))
    port = free_port()
    argv = [str(INFINITY_EMB), "v2", "--model-id", str(folder), "--served-model-name", MODEL_NAME, "--device", "cpu",
            "--engine", "torch", "--batch-size", str(BATCH), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]
    log_path = OUT_DIR / f"{stamp}-images-infinity.log"
    print(f"\n== infinity-emb\n$ {' '.join(argv)}\n  log: {log_path}", flush=True)
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        server = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env={**os.environ, **_INFINITY_ENV})
        try:
            wait_healthy(url, server, args.health_timeout)
            return bench_loads(args, "infinity-emb", url, "/embeddings_image", server.pid, ceil)
        except RuntimeError as exc:
            print(f"  infinity-emb could not serve the folder: {exc} (see {log_path})", flush=True)
            return [{"server": "infinity-emb", "error": str(exc)}]
        finally:
            stop_server(server)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image-loads", default="1x1,8x8", help="IMAGESxCONCURRENCY list")
    parser.add_argument("--text-loads", default="1x1,32x8", help="TEXTSxCONCURRENCY list")
    parser.add_argument("--peer", action="store_true", help="also infinity-emb 0.0.78 (bench/setup_infinity.sh)")
    parser.add_argument("--engines", default="auto", help="our engines to serve the model on, one server each "
                                                         "(comma-separated ENGINE[:DTYPE]: auto, onnx:int8, torch)")
    add_measurement_args(parser, warmup=5.0, health_timeout=600.0)
    parser.add_argument("--ceiling", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> int:
    args = _parse_args()
    if args.ceiling:
        print(json.dumps(ceiling(args.threads, args.ceiling_duration)))
        return 0
    stamp = start_run()
    print(f"model: {build_model()}", flush=True)
    ceil = measure_child(args, [sys.executable, "-m", "bench.images", "--ceiling", "--threads", str(args.threads),
                                "--ceiling-duration", str(args.ceiling_duration)])
    print(f"  in-process loop: {ceil['images_per_s']:.1f} images/s, {ceil['texts_per_s']:.1f} texts/s, "
          f"others' CPU {ceil['others_during']:.0%}", flush=True)
    rows = []
    for choice in args.engines.split(","):
        engine, _, dtype = choice.partition(":")
        label = choice.replace(":", "-")
        name = "ours" if choice == "auto" else f"ours-{label}"
        ours = ConfiguredServer.prepare(f'[[models]]\nname = "{MODEL_NAME}"\nsource = "{MODEL_DIR}"\n'
                                        f'engine = "{engine}"\ndtype = "{dtype or "auto"}"\n', f"images-{label}", stamp)
        with ours.running(args.health_timeout) as server:
            rows += bench_loads(args, name, ours.url, "/embeddings", server.pid, ceil)
    if args.peer:
        rows += bench_peer(args, ceil, stamp)
    (OUT_DIR / f"{stamp}-images.json").write_text(json.dumps({"date": stamp, "args": vars(args), "ceiling": ceil,
                                                                "loads": rows}, indent=2) + "\n")
    print(f"saved bench/out/{stamp}-images.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
