"""Image-text benchmark (the `clip` family of bench/media.py): images/s and texts/s of a
CLIP of ViT-B/32 size served by us and by infinity-emb (its `/embeddings_image`), against
an in-process transformers loop on the same folder, in one run.

No CLIP weights are available offline, so the model is built once from transformers'
default `CLIPConfig` (ViT-B/32: a 12-layer 768-wide vision tower on 224x224 images in
32x32 patches, a 12-layer 512-wide text tower, projections to 512) with random weights,
over the packaged all-MiniLM-L6-v2 WordPiece tokenizer (its [SEP] the text tower's
end-of-text token), with CLIP's image processor, in ``~/.cache/infinity-bench/clip-vit-b32``.
Speed does not depend on the values.

Workload: 64 distinct 320x240 JPEG photographs' worth of noise (about 70 KB each, as data:
URIs), and captions: corpus sentences cut to 12 words. The loop decodes the same JPEG
bytes with Pillow, runs the processor and `get_image_features` / `get_text_features`.

Usage:
    .venv/bin/python -m bench.images [--peer] [--engines auto,torch]
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from pathlib import Path

from bench import media

MODEL_DIR = media.CACHE / "clip-vit-b32"


def build_folder(folder: Path) -> None:
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = media.wordpiece_tokenizer(77)
    config = CLIPConfig(text_config={"eos_token_id": tokenizer.sep_token_id, "bos_token_id": tokenizer.cls_token_id,
                                     "pad_token_id": tokenizer.pad_token_id})
    torch.manual_seed(0)
    CLIPModel(config).eval().save_pretrained(folder)
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer).save_pretrained(folder)


def photos(count: int = 64) -> list[bytes]:
    return media.jpeg_noise(count, (320, 240))


def loop(folder: Path, threads: int) -> tuple[Callable[[list[bytes]], None], Callable[[list[str]], None]]:
    import torch
    from PIL import Image
    from transformers import AutoModel, AutoProcessor

    torch.set_num_threads(threads)
    model, processor = AutoModel.from_pretrained(str(folder)).eval(), AutoProcessor.from_pretrained(str(folder))

    def images(batch: list[bytes]) -> None:
        decoded = [Image.open(io.BytesIO(data)).convert("RGB") for data in batch]
        with torch.inference_mode():
            model.get_image_features(**processor(images=decoded, return_tensors="pt"))

    def texts(batch: list[str]) -> None:
        with torch.inference_mode():
            model.get_text_features(**processor(text=batch, padding=True, truncation=True, return_tensors="pt"))

    return images, texts


if __name__ == "__main__":
    sys.exit(media.main(family_name="clip"))
