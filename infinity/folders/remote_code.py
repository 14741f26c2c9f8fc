"""Folders that ship their own modelling code: an `auto_map` in config.json (the model's
classes) or tokenizer_config.json (the tokenizer's) naming modules of the folder, or of
another hub repository ("org/repo--module.Class"), that transformers imports and runs.
Such a folder is served only where its models.toml entry trusts it (`trust_remote_code`),
and on torch alone (`infinity.shared.folders.engine_refusal`). Code that lives in another
repository is fetched here, in the front end before any child starts, so that a start
which cannot fetch it fails naming the repository.
"""

from __future__ import annotations

import json
from pathlib import Path

from infinity.config import ConfigError, ModelConfig


def shipped_code(folder: Path, config: dict) -> dict[str, list[str]]:
    """The classes ("module.Class", or "org/repo--module.Class") each file of `folder`
    maps transformers' auto classes to, by file name (`config` is its config.json); empty
    for a folder that ships no code."""
    tokenizer_config = folder / "tokenizer_config.json"
    maps = {"config.json": config.get("auto_map"),
            "tokenizer_config.json": json.loads(tokenizer_config.read_text()).get("auto_map")
            if tokenizer_config.is_file() else None}
    code = {}
    for name, auto_map in maps.items():
        # A tokenizer's entry is a [slow, fast] pair, either of which may be null.
        classes = [ref for value in (auto_map or {}).values()
                   for ref in (value if isinstance(value, list) else [value]) if ref]
        if classes:
            code[name] = sorted(set(classes))
    return code


def check_trusted(model: ModelConfig, folder: Path, config: dict) -> None:
    """Refuse (`ConfigError`) a folder that ships code unless `model` trusts it; for one
    that is trusted, fetch the code its config.json takes from other hub repositories."""
    code = shipped_code(folder, config)
    if not code:
        return
    if not model.trust_remote_code:
        listed = "; ".join(f"{name} auto_map: {', '.join(classes)}" for name, classes in code.items())
        raise ConfigError(f"model '{model.name}': its folder {folder} ships its own code, which would run in the "
                          f"server ({listed}); if you trust that code, set trust_remote_code = true in its "
                          "[[models]] entry of models.toml")
    # "org/repo--module.Class", as transformers splits it.
    for repository, module in sorted({(ref.split("--")[0], ref.split("--")[1].split(".")[0] + ".py")
                                      for ref in code.get("config.json", []) if "--" in ref}):
        _fetch(model, repository, module)


def _fetch(model: ModelConfig, repository: str, module: str) -> None:
    """Download `module` (a file name) of the hub `repository` into the hub's cache, where
    transformers finds it when a child loads the model (offline too). Nothing runs here:
    the code is imported by the children only."""
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(repository, module)
    except Exception as exc:  # offline, a repository or file gone: all end the start
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(
            f"model '{model.name}': its config.json's auto_map takes code from the hub repository {repository} "
            f"({module}), which could not be downloaded ({type(exc).__name__}: {reason}); start once with access "
            "to the Hugging Face hub (the code is cached), or copy that code into the folder and name its modules "
            "in auto_map without the repository"
        ) from None
