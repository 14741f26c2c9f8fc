"""Media benchmark: media items/s and texts/s of a model that sees or hears, served by us
(and by infinity-emb where it loads the folder), against an in-process transformers loop
on the same folder, in one run.

Families (each a folder built once from its transformers config with random weights,
in ``~/.cache/infinity-bench/``: speed does not depend on the values; media generated
here):

- ``clip`` (bench/images.py): a ViT-B/32 CLIP, 320x240 JPEG photographs' worth of noise;
- ``clap``: transformers' default ``ClapConfig`` (LAION's HTSAT audio tower on 10 s at
  48 kHz, a RoBERTa-base-sized text tower) over the packaged WordPiece tokenizer, 5 s
  48 kHz PCM16 WAV clips (a chirp and noise each);
- ``colpali``: a ColPali of reduced size (a SigLIP-B/16 vision tower on 224x224 pages,
  196 image tokens, and a 6-layer 1024-wide Gemma; the released 3B model would give a
  fraction of a page per second on 2 CPU cores), 640x480 JPEG pages.

The loop (measured before the servers and again after them, the machine's speed drifts)
decodes the same bytes the servers get (Pillow; transformers' ``load_audio``),
runs the folder's processor and the model in batches of ``BATCH`` (``--threads`` torch
threads). Each server gets closed-loop loads of ITEMSxCONCURRENCY.

Usage:
    .venv/bin/python -m bench.media --family clap [--peer]
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench import cpu
from workers.inference.corpus import sentences
from bench.loadgen import closed_loop
from bench.run import (_INFINITY_ENV, ConfiguredServer, INFINITY_EMB, OUT_DIR, REPO, add_measurement_args, free_port,
                       least_disturbed, measure_child, parse_pairs, start_run, stop_server, wait_healthy, wait_quiet)

CACHE = Path.home() / ".cache" / "infinity-bench"
MODEL_NAME = "model"
BATCH = 16
CAPTION_WORDS = 12
BUILT_MARKER = ".bench-built"


@dataclass(frozen=True)
class Family:
    name: str
    modality: str  # of its media items
    folder: Path
    build: Callable[[Path], None]  # writes the folder
    media: Callable[[], list[bytes]]  # the files the clients send, as data: URIs
    mime: str
    # The in-process loop's forward of a batch of decoded media files, and of texts.
    loop: Callable[[Path, int], tuple[Callable[[list[bytes]], None], Callable[[list[str]], None]]]
    # infinity-emb's route for the media, or why it cannot serve the folder.
    peer_route: str | None
    peer_missing: str = ""


def built(family: Family) -> Path:
    """The family's folder, built once (into a staging folder renamed into place)."""
    if not (family.folder / BUILT_MARKER).is_file():
        staging = family.folder.with_name(f"{family.folder.name}.tmp-{os.getpid()}")
        family.build(staging)
        (staging / BUILT_MARKER).write_text(f"{family.name}: random weights, seed 0\n")
        os.replace(staging, family.folder)
    return family.folder


def captions(count: int = 4096) -> list[str]:
    """Corpus sentences cut to their first 12 words (about 15 tokens)."""
    return [" ".join(text.split()[:CAPTION_WORDS]) for text in sentences(count, 0)]


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def wordpiece_tokenizer(model_max_length: int):  # noqa: ANN201 (transformers stays lazy)
    """The packaged all-MiniLM-L6-v2 WordPiece tokenizer as a transformers fast tokenizer."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from infinity.folders.resolve import packaged_model_folder

    wordpiece = Tokenizer.from_file(str(packaged_model_folder() / "tokenizer.json"))
    wordpiece.no_padding()  # the packaged file pads every text to 128
    wordpiece.no_truncation()
    return PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=model_max_length)


def jpeg_noise(count: int, size: tuple[int, int]) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, "JPEG", quality=85)
        out.append(buffer.getvalue())
    return out


# --- CLAP ----------------------------------------------------------------------------------------

def _build_clap(folder: Path) -> None:
    import torch
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor

    tokenizer = wordpiece_tokenizer(512)
    config = ClapConfig(text_config={"vocab_size": tokenizer.vocab_size, "pad_token_id": tokenizer.pad_token_id,
                                     "bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id})
    torch.manual_seed(0)
    ClapModel(config).eval().save_pretrained(folder)
    ClapProcessor(feature_extractor=ClapFeatureExtractor(truncation="rand_trunc"),
                  tokenizer=tokenizer).save_pretrained(folder)


def _clips(count: int = 32, seconds: float = 5.0, rate: int = 48000) -> list[bytes]:
    import wave

    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * rate)) / rate
    out = []
    for i in range(count):
        samples = 0.3 * np.sin(2 * np.pi * (200 + 40 * i) * t * (1 + t)) + 0.05 * rng.standard_normal(len(t))
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as file:
            file.setnchannels(1)
            file.setsampwidth(2)
            file.setframerate(rate)
            file.writeframes((samples * 32767).astype("<i2").tobytes())
        out.append(buffer.getvalue())
    return out


def _clap_loop(folder: Path, threads: int) -> tuple[Callable[[list[bytes]], None], Callable[[list[str]], None]]:
    import torch
    from transformers import AutoFeatureExtractor, AutoModel, AutoTokenizer
    from transformers.audio_utils import load_audio

    torch.set_num_threads(threads)
    model = AutoModel.from_pretrained(str(folder)).eval()
    extractor, tokenizer = AutoFeatureExtractor.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(folder))

    def clips(batch: list[bytes]) -> None:
        waves = [load_audio(data_uri(data, "audio/wav"), sampling_rate=extractor.sampling_rate, backend="soundfile")
                 for data in batch]
        features = extractor(waves, sampling_rate=extractor.sampling_rate, return_tensors="pt")["input_features"]
        with torch.inference_mode():
            model.get_audio_features(input_features=features, is_longer=torch.zeros((len(batch), 1), dtype=torch.bool))

    def texts(batch: list[str]) -> None:
        with torch.inference_mode():
            model.get_text_features(**tokenizer(batch, padding=True, truncation=True, return_tensors="pt"))

    return clips, texts


# --- ColPali -------------------------------------------------------------------------------------

def _build_colpali(folder: Path) -> None:
    import torch
    from transformers import (ColPaliConfig, ColPaliForRetrieval, ColPaliProcessor, PaliGemmaConfig,
                              SiglipImageProcessor)

    image_processor = SiglipImageProcessor(size={"height": 224, "width": 224})
    image_processor.image_seq_length = (224 // 16) ** 2
    processor = ColPaliProcessor(image_processor=image_processor, tokenizer=wordpiece_tokenizer(512))
    vocabulary = len(processor.tokenizer)
    vlm = PaliGemmaConfig(
        text_config={"model_type": "gemma", "vocab_size": vocabulary, "hidden_size": 1024, "intermediate_size": 4096,
                     "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 128},
        vision_config={"model_type": "siglip_vision_model", "image_size": 224, "patch_size": 16},
        image_token_index=processor.image_token_id, vocab_size=vocabulary, projection_dim=1024, hidden_size=1024)
    torch.manual_seed(0)
    ColPaliForRetrieval(ColPaliConfig(vlm_config=vlm, embedding_dim=128)).eval().save_pretrained(folder)
    processor.save_pretrained(folder)


def _colpali_loop(folder: Path, threads: int) -> tuple[Callable[[list[bytes]], None], Callable[[list[str]], None]]:
    import torch
    from PIL import Image
    from transformers import AutoProcessor, ColPaliForRetrieval

    torch.set_num_threads(threads)
    model, processor = ColPaliForRetrieval.from_pretrained(str(folder)).eval(), AutoProcessor.from_pretrained(str(folder))

    def run(encoded: dict) -> None:
        with torch.inference_mode():
            model(**{key: value for key, value in encoded.items() if key != "labels"})

    def pages(batch: list[bytes]) -> None:
        run(processor.process_images([Image.open(io.BytesIO(data)).convert("RGB") for data in batch]))

    def queries(batch: list[str]) -> None:
        run(processor.process_queries(batch))

    return pages, queries


def _families() -> dict[str, Family]:
    from bench import images

    return {
        "clip": Family("clip", "image", images.MODEL_DIR, images.build_folder, images.photos, "image/jpeg",
                       images.loop, "/embeddings_image"),
        "clap": Family("clap", "audio", CACHE / "clap-default", _build_clap, _clips, "audio/wav", _clap_loop,
                       "/embeddings_audio"),
        "colpali": Family("colpali", "image", CACHE / "colpali-small", _build_colpali,
                          lambda: jpeg_noise(32, (640, 480)), "image/jpeg", _colpali_loop, None,
                          "infinity-emb 0.0.78 loads colpali-engine checkpoints only, not transformers' "
                          "ColPaliForRetrieval folders"),
    }


# --- measurements --------------------------------------------------------------------------------

def ceiling(family: Family, threads: int, duration: float) -> dict[str, float]:
    """Media items/s and texts/s of the in-process loop, batches of `BATCH`."""
    media, texts = family.loop(family.folder, threads)
    result = {}
    for name, run, items in (("media", media, family.media()), ("texts", texts, captions())):
        run(items[:BATCH])  # one-time costs
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < duration:
            run([items[(done + i) % len(items)] for i in range(BATCH)])
            done += BATCH
        result[f"{name}_per_s"] = done / (time.perf_counter() - start)
    return result


def load(args: argparse.Namespace, family: Family, url: str, route: str, kind: str, items: int, concurrency: int,
         pgid: int) -> dict[str, float]:
    """One closed-loop load of `items` media items (`kind` "media") or texts per request."""
    others_before = wait_quiet(args, pgid)
    pool = [data_uri(data, family.mime) for data in family.media()] if kind == "media" else captions()
    position = [0]

    def check(payload: object) -> None:
        if not isinstance(payload, dict) or len(payload.get("data", [])) != items:
            raise ValueError(f"expected {items} items")

    def next_request() -> tuple[dict[str, object], object]:
        start = position[0]
        position[0] = (start + items) % len(pool)
        body = {"model": MODEL_NAME, "input": [pool[(start + i) % len(pool)] for i in range(items)]}
        if kind == "media" and route == "/embeddings":
            body["modality"] = family.modality
        return body, check

    before, by_process = cpu.sample(pgid), cpu.ticks_by_name(pgid)
    window = asyncio.run(closed_loop(url, route, next_request, concurrency=concurrency, duration=args.duration,
                                     warmup=args.warmup, timeout=300.0))
    return {"kind": kind, "items": items, "concurrency": concurrency,
            "per_s": window.good * items / args.duration, "p50_ms": window.percentile(50),
            "errors": window.errors, "first_error": window.first_error, "others_before": others_before,
            "others_during": cpu.other_share(before, cpu.sample(pgid)),
            "server_cpu_by_process": cpu.shares_by_name(by_process, cpu.ticks_by_name(pgid))}


def bench_loads(args: argparse.Namespace, family: Family, name: str, url: str, media_route: str, pgid: int,
                ceil: dict[str, float]) -> list[dict[str, float]]:
    rows = []
    for kind, loads in (("media", args.media_loads), ("texts", args.text_loads)):
        route = media_route if kind == "media" else "/embeddings"
        for items, concurrency in parse_pairs(loads):
            row = least_disturbed(args, lambda: load(args, family, url, route, kind, items, concurrency, pgid),
                                  lambda r: r["others_during"])
            row["server"] = name
            rows.append(row)
            ratio = row["per_s"] / ceil[f"{kind}_per_s"]
            print(f"  {name}: {items} {kind} x c{concurrency}: {row['per_s']:.1f}/s ({ratio:.2f} of the in-process "
                  f"loop), p50 {row['p50_ms']:.0f} ms, errors {row['errors']}"
                  + (f" ({row['first_error']})" if row["first_error"] else "")
                  + f", others' CPU {row['others_during']:.0%}", flush=True)
            print(f"    the server's CPU time by process: {row['server_cpu_by_process']}", flush=True)
    return rows


def bench_peer(args: argparse.Namespace, family: Family, ceil: dict[str, float], stamp: str) -> list[dict]:
    """infinity-emb 0.0.78 on a copy of the folder whose tokenizer_config names a class
    transformers 4 knows (transformers 5 writes `TokenizersBackend`)."""
    if family.peer_route is None:
        print(f"\n== infinity-emb: not run: {family.peer_missing}", flush=True)
        return [{"server": "infinity-emb", "error": family.peer_missing}]
    folder = family.folder.with_name(family.folder.name + "-for-infinity")
    if not folder.is_dir():
        subprocess.run(["cp", "-r", str(family.folder), str(folder)], check=True)
        settings = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**settings,
                                                                  "tokenizer_class": "PreTrainedTokenizerFast"}))
    port = free_port()
    argv = [str(INFINITY_EMB), "v2", "--model-id", str(folder), "--served-model-name", MODEL_NAME, "--device", "cpu",
            "--engine", "torch", "--batch-size", str(BATCH), "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning"]
    log_path = OUT_DIR / f"{stamp}-{family.name}-infinity.log"
    print(f"\n== infinity-emb\n$ {' '.join(argv)}\n  log: {log_path}", flush=True)
    url = f"http://127.0.0.1:{port}"
    with log_path.open("wb") as log:
        server = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True, env={**os.environ, **_INFINITY_ENV})
        try:
            wait_healthy(url, server, args.health_timeout)
            return bench_loads(args, family, "infinity-emb", url, family.peer_route, server.pid, ceil)
        except RuntimeError as exc:
            print(f"  infinity-emb could not serve the folder: {exc} (see {log_path})", flush=True)
            return [{"server": "infinity-emb", "error": str(exc)}]
        finally:
            stop_server(server)


def measure_loop(args: argparse.Namespace, family: Family) -> dict[str, float]:
    ceil = measure_child(args, [sys.executable, "-m", "bench.media", "--family", family.name, "--ceiling",
                                "--threads", str(args.threads), "--ceiling-duration", str(args.ceiling_duration)])
    print(f"  in-process loop: {ceil['media_per_s']:.1f} {family.modality} items/s, {ceil['texts_per_s']:.1f} texts/s,"
          f" others' CPU {ceil['others_during']:.0%}", flush=True)
    return ceil


def summarize(rows: list[dict], before: dict[str, float], after: dict[str, float]) -> None:
    """Each load against the loop measured before the servers and after them: the machine's
    speed drifts over a run (by a fifth and more here), and the servers ran in between."""
    print("\n| server | load | per s | of the loop before | after | of their mean |\n| --- | --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        if "per_s" not in row:
            continue
        key = f"{row['kind']}_per_s"
        mean = (before[key] + after[key]) / 2
        print(f"| {row['server']} | {row['items']} {row['kind']} x c{row['concurrency']} | {row['per_s']:.1f} | "
              f"{row['per_s'] / before[key]:.2f} | {row['per_s'] / after[key]:.2f} | {row['per_s'] / mean:.2f} |")


def parse_args(argv: list[str] | None = None, family: str | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if family is None:
        parser.add_argument("--family", choices=("clip", "clap", "colpali"), required=True)
    parser.add_argument("--media-loads", "--image-loads", default="1x1,8x8", help="ITEMSxCONCURRENCY list")
    parser.add_argument("--text-loads", default="1x1,32x8", help="TEXTSxCONCURRENCY list")
    parser.add_argument("--peer", action="store_true", help="also infinity-emb 0.0.78 (bench/setup_infinity.sh)")
    parser.add_argument("--engines", default="auto", help="our engines to serve the model on, one server each "
                                                         "(comma-separated ENGINE[:DTYPE]: auto, onnx:int8, torch)")
    add_measurement_args(parser, warmup=5.0, health_timeout=600.0)
    parser.add_argument("--ceiling", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if family is not None:
        args.family = family
    return args


def main(argv: list[str] | None = None, family_name: str | None = None) -> int:
    args = parse_args(argv, family_name)
    family = _families()[args.family]
    if args.ceiling:
        print(json.dumps(ceiling(family, args.threads, args.ceiling_duration)))
        return 0
    stamp = start_run()
    print(f"model: {built(family)}", flush=True)
    ceil = measure_loop(args, family)
    rows = []
    for choice in args.engines.split(","):
        engine, _, dtype = choice.partition(":")
        label = f"{family.name}-{choice.replace(':', '-')}"
        name = "ours" if choice == "auto" else f"ours-{choice.replace(':', '-')}"
        ours = ConfiguredServer.prepare(f'[[models]]\nname = "{MODEL_NAME}"\nsource = "{family.folder}"\n'
                                        f'engine = "{engine}"\ndtype = "{dtype or "auto"}"\n', label, stamp)
        with ours.running(args.health_timeout) as server:
            rows += bench_loads(args, family, name, ours.url, "/embeddings", server.pid, ceil)
    if args.peer:
        rows += bench_peer(args, family, ceil, stamp)
    print("\n== the loop again, after the servers", flush=True)
    ceil_after = measure_loop(args, family)
    summarize(rows, ceil, ceil_after)
    (OUT_DIR / f"{stamp}-{family.name}.json").write_text(json.dumps({"date": stamp, "args": vars(args),
                                                                      "ceiling": ceil, "ceiling_after": ceil_after,
                                                                      "loads": rows}, indent=2) + "\n")
    print(f"saved bench/out/{stamp}-{family.name}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
