"""Where a model's files are: a local folder, a Hugging Face repo id, or the embedded model.

Backend neutral: both backends resolve models here.
"""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

from .errors import ModelError

# Files a model needs, as mlx-lm downloads them (Kimi's tokenizer is tiktoken.model alone);
# the hub may hold much more (other formats, originals).
HUB_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken",
                "tiktoken.model", "*.txt", "*.jsonl", "*.jinja"]


# A small trained bilingual (Italian/English) + Python MoE shipped with the package.
EMBEDDED_MODEL = Path(__file__).parent / "assets" / "embedded"



def check_tokenizer(path: Path, tokenizer) -> None:
    """A folder without tokenizer files loads, in mlx-lm and transformers alike, as a tokenizer
    of one token built from config.json's model type: it encodes every text as nothing, and
    generation failed with a message about missing inputs."""
    if len(tokenizer.get_vocab()) < 2:
        raise ModelError(f"{path}: no tokenizer files (tokenizer.json, tokenizer.model, "
                         "vocab.json, ...): the model has no tokenizer to read text with")


def resolve_model_path(model: str | Path | None, revision: str | None = None) -> Path:
    """A local model directory, a Hugging Face repo id resolved through the local cache/hub, or
    None / "embedded" for the model shipped with the package."""
    if isinstance(model, str) and not model.strip():  # Path("") is the current folder
        raise ModelError("no model given: the name is empty")
    if model is None or model == "embedded":
        if not (EMBEDDED_MODEL / "config.json").exists():
            raise ModelError(f"the embedded model is missing from {EMBEDDED_MODEL}")
        return EMBEDDED_MODEL
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelError(f"{path} is a file; give the model's directory")
    text = str(model)
    if isinstance(model, Path) or text.startswith(("/", ".", "~")) or text.count("/") > 1:
        raise ModelError(f"no such directory: {path} (a Hugging Face repo id is NAME or "
                         f"OWNER/NAME)")
    try:
        return Path(snapshot_download(str(model), revision=revision, allow_patterns=HUB_PATTERNS))
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(
            f"'{model}' is not a local directory and could not be resolved on the Hugging Face "
            f"hub or its local cache: {reason}"
        ) from None
