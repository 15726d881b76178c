"""Workload activation profiles: which experts a workload uses, saved to pre-warm later sessions.

A profile is human-readable JSON: per MoE layer, how many tokens were routed to each expert
(raw and exponentially decayed), plus a fingerprint of the model it was recorded on so that a
profile is never applied to another model. Plain Python and numpy (no mlx).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from .errors import ProfileError
from .files import atomic_write_text, check_replaceable, read_json

SCHEMA = "mlx-moestream-profile"
VERSION = 1
ENV_DIR = "MLX_MOESTREAM_PROFILES"



@dataclass
class Profile:
    workload: str
    model: dict  # model_type, moe_layers, experts, top_k, fingerprint
    counts: np.ndarray  # [layers, experts] tokens routed to each expert
    decayed: np.ndarray  # [layers, experts] the same, halved every `half_life_tokens`
    tokens: int
    half_life_tokens: int
    layer_names: list[str]
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    path: Path | None = None  # the file it was loaded from, to name in errors

    @property
    def named(self) -> str:
        return f"'{self.workload}'" + (f" ({self.path})" if self.path else "")

    @classmethod
    def of(cls, stats, workload: str, model: dict) -> "Profile":
        """The profile of a session's `stats.Stats` (what `save_profile` writes)."""
        return cls(workload, model, stats.activations.copy(), stats.decayed.copy(), stats.tokens,
                   stats.half_life_tokens, list(stats.layer_names))

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "version": VERSION,
            "workload": self.workload,
            "created": self.created,
            "model": self.model,
            "tokens": self.tokens,
            "half_life_tokens": self.half_life_tokens,
            "layers": [
                {"name": name, "counts": c.tolist(), "decayed": [round(float(v), 3) for v in d]}
                for name, c, d in zip(self.layer_names, self.counts, self.decayed)
            ],
        }

    def save(self, path: str | Path) -> Path:
        """Write atomically: a crash never leaves a half-written profile behind, and nothing
        `load` would refuse is written."""
        path = Path(path)
        problem = _problem(self.counts, self.decayed, self.tokens, self.half_life_tokens)
        if problem:
            raise ProfileError(f"cannot save profile {path}: {problem}")
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @staticmethod
    def read(path: Path) -> dict:
        """A profile file's content, of any version: what saving may replace (another version
        of this tool wrote it too)."""
        data = read_json(path, "not a readable profile", ProfileError)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise ProfileError(f"{path}: not an mlx-moestream profile (schema != '{SCHEMA}')")
        return data

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        path = Path(path)
        data = cls.read(path)
        if data.get("version") != VERSION:
            raise ProfileError(f"{path}: profile version {data.get('version')} is not {VERSION}")
        try:
            layers = data["layers"]
            counts = np.array([l["counts"] for l in layers], dtype=np.float64)  # checked below
            decayed = np.array([l["decayed"] for l in layers], dtype=np.float64)
            workload, model = str(data["workload"]), dict(data["model"])
            tokens, half_life = int(data["tokens"]), int(data["half_life_tokens"])
            names, created = [str(l["name"]) for l in layers], str(data["created"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise ProfileError(f"{path}: malformed profile ({type(e).__name__}: {e})") from None
        problem = _problem(counts, decayed, tokens, half_life)
        texts = {"workload": workload, "created": created, **{f"model.{k}": v for k, v in
                                                              model.items() if isinstance(v, str)}}
        unprintable = [k for k, v in texts.items() if not v.isprintable()]
        if unprintable:  # shown on the terminal: escape sequences would act there
            problem = f"its {unprintable[0]} holds control characters"
        if problem:
            raise ProfileError(f"{path}: malformed profile ({problem})")
        profile = cls(workload, model, counts.astype(np.int64), decayed, tokens, half_life, names,
                      created, path)
        profile.check_shape(model, "malformed profile", "its own model record")
        return profile

    def check_model(self, model: dict, source: str = "profile", target: str = "this model"
                    ) -> None:
        """Refuse a profile recorded on another model, saying which, or whose counts do not
        have the model's shape (one row per MoE layer, one count per expert). A profile
        without a fingerprint (from another tool) matches no model."""
        fingerprint = self.model.get("fingerprint")
        if fingerprint is None or fingerprint != model.get("fingerprint"):
            raise ProfileError(
                f"{source} {self.named} was recorded on {describe(self.model)} "
                f"but {target} is {describe(model)}"
            )
        self.check_shape(model, source, target)

    def check_shape(self, model: dict, source: str = "profile", target: str = "this model"
                    ) -> None:
        """Refuse counts that are not one row per MoE layer of `model` (its `moe_layers`, where
        known), one count per expert."""
        shape = (model.get("moe_layers"), model.get("experts"))
        if None not in shape and self.counts.shape != shape:
            raise ProfileError(
                f"{source} {self.named} has counts for {self.counts.shape[0]} layers x "
                f"{self.counts.shape[1]} experts, but {target} has {shape[0]} x {shape[1]}"
            )

    def hottest(self, limit: int, per_layer: list[int] | None = None) -> list[tuple[int, int]]:
        """The most used (layer, expert) pairs, hottest first, at most `per_layer[l]` per layer."""
        order = np.argsort(-self.decayed, axis=None, kind="stable")
        taken = np.zeros(len(self.decayed), np.int64)
        picked = []
        for flat in order.tolist():
            layer, expert = divmod(flat, self.decayed.shape[1])
            if len(picked) == limit or self.decayed[layer, expert] <= 0:
                break
            if per_layer is not None and taken[layer] >= per_layer[layer]:
                continue
            taken[layer] += 1
            picked.append((layer, expert))
        return picked

    def seed_counts(self, uses: float) -> np.ndarray:
        """Decayed counts rescaled per layer so the hottest expert counts `uses`: a policy
        seeded with them trusts the profile only as much as a few live uses."""
        peak = self.decayed.max(axis=1, keepdims=True)
        return np.where(peak > 0, self.decayed / np.where(peak > 0, peak, 1) * uses, 0.0)

    def working_set(self) -> np.ndarray:
        """Per layer, the effective number of experts in use: 2 ** (routing entropy in bits)."""
        p = self.counts / np.maximum(self.counts.sum(axis=1, keepdims=True), 1)
        entropy = -np.where(p > 0, p * np.log2(np.where(p > 0, p, 1)), 0).sum(axis=1)
        return 2.0**entropy

    def coverage(self, top_n: int) -> np.ndarray:
        """Per layer, the share of activations that the `top_n` most used experts carry."""
        top = np.sort(self.counts, axis=1)[:, ::-1][:, :top_n].sum(axis=1)
        return top / np.maximum(self.counts.sum(axis=1), 1)


def _problem(counts: np.ndarray, decayed: np.ndarray, tokens: int, half_life: int) -> str | None:
    """What makes a profile's numbers unusable, if anything."""
    if (counts.ndim != 2 or counts.shape != decayed.shape or 0 in counts.shape
            or not ((counts >= 0) & (counts < 2**53) & (counts == counts.round())).all()):
        return "counts must be [layers, experts], at least one of each, whole numbers >= 0"
    if not np.isfinite(decayed).all() or (decayed < 0).any():
        return "decayed counts must be finite, >= 0"
    if tokens < 0 or half_life < 1:
        return "tokens must be >= 0 and half_life_tokens >= 1"
    return None


def describe(model: dict) -> str:
    """A profile's model in words; any field may be missing (a profile from another tool)."""
    return (f"{model.get('model_type')} ({model.get('moe_layers')} MoE layers x "
            f"{model.get('experts')} experts, top-{model.get('top_k')}, "
            f"fingerprint {str(model.get('fingerprint'))[:12]})")


def user_dir() -> Path:
    return Path(os.environ.get(ENV_DIR) or Path.home() / ".cache" / "mlx-moestream" / "profiles")


def search_dirs() -> list[Path]:
    """Where NAME is looked up: ./profiles, the user directory, the profiles shipped with the package.

    The repo's profiles/ folder is installed as `mlx_moestream.bundled_profiles`; an editable
    install (`pip install -e .`) has no such package, and reads the checkout's folder instead.
    """
    dirs = [Path("profiles"), user_dir()]
    spec = importlib.util.find_spec("mlx_moestream.bundled_profiles")
    if spec is not None and spec.submodule_search_locations:
        dirs.append(Path(list(spec.submodule_search_locations)[0]))
    else:
        dirs.append(Path(__file__).resolve().parent.parent / "profiles")
    return dirs


def _is_path(name: str) -> bool:
    return _json_file(name) or os.sep in name or "/" in name


def _json_file(name: str) -> bool:
    return name.lower().endswith(".json")  # `P.JSON` too: saving it as `P.JSON.json` surprises


def find(name: str) -> Path:
    """A profile NAME (searched in `search_dirs()`) or a path to a .json file."""
    try:
        if _is_path(name):
            path = Path(name).expanduser()
            if not path.exists():
                raise ProfileError(f"profile file {path} does not exist")
            return path
        for folder in search_dirs():
            if (folder / f"{name}.json").exists():
                return folder / f"{name}.json"
    except OSError as e:  # a name too long, a folder that may not be searched
        raise ProfileError(f"profile '{name}': {e.strerror}") from None
    where = ", ".join(str(d) for d in search_dirs())
    raise ProfileError(f"no profile named '{name}' (looked in {where})")


def save_target(name: str | Path) -> Path:
    """Where saving NAME writes, checked before anything is recorded: a NAME (letters, digits,
    `.`, `_`, `-`) goes to ./profiles if it exists, else the user directory (made now, so that
    the path this returns passes this check again); a path (a `Path`, or a string ending in
    `.json`) must be in an existing folder. An existing file is replaced only if it is a
    profile (of any version)."""
    if isinstance(name, Path) or _json_file(name):
        path = Path(name).expanduser()
        if not path.parent.is_dir():
            raise ProfileError(f"cannot save profile {path}: no folder {path.parent}")
    elif re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]*", name):
        folder = Path("profiles") if Path("profiles").is_dir() else user_dir()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ProfileError(f"cannot save profile {name}: cannot make {folder}: "
                               f"{e.strerror}") from None
        path = folder / f"{name}.json"
    else:
        raise ProfileError(f"'{name}' is neither a profile name (letters, digits, '.', '_', '-') "
                           f"nor a path ending in .json")
    check_replaceable(path, Profile.read, "an mlx-moestream profile", ProfileError)
    return path


def list_all() -> list[Path]:
    """Every profile file found, the first of each name (unreadable ones included: the
    caller reports them one by one)."""
    seen, out = set(), []
    for folder in search_dirs():
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
            if path.stem not in seen:
                seen.add(path.stem)
                out.append(path)
    return out


def merge(a: Profile, b: Profile, workload: str) -> Profile:
    """Sum two profiles of the same model (e.g. two sessions of one workload)."""
    b.check_model(a.model, "second profile", "the first profile's model")
    with np.errstate(over="ignore"):  # sums out of range are refused when saved
        return Profile(workload, a.model, a.counts + b.counts, a.decayed + b.decayed,
                       a.tokens + b.tokens, a.half_life_tokens, a.layer_names)


def js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence (bits) between per-row distributions of counts."""
    p = p / np.maximum(p.sum(axis=-1, keepdims=True), 1e-12)
    q = q / np.maximum(q.sum(axis=-1, keepdims=True), 1e-12)
    m = (p + q) / 2

    def kl(a, b):
        return np.where(a > 0, a * np.log2(np.where(a > 0, a, 1) / np.where(b > 0, b, 1)), 0).sum(-1)

    return (kl(p, m) + kl(q, m)) / 2


def diff(a: Profile, b: Profile, top_n: int) -> list[dict]:
    """Per layer: JS divergence of the two expert distributions and overlap of their top-N
    (N at most the experts of a layer)."""
    b.check_model(a.model, "second profile", "the first profile's model")
    jsd = js_divergence(a.counts.astype(float), b.counts.astype(float))
    top_n = min(top_n, a.counts.shape[1])
    rows = []
    for layer in range(len(a.counts)):
        top_a = set(np.argsort(-a.counts[layer], kind="stable")[:top_n].tolist())
        top_b = set(np.argsort(-b.counts[layer], kind="stable")[:top_n].tolist())
        rows.append({"layer": layer, "js_divergence": float(jsd[layer]),
                     "top_overlap": len(top_a & top_b) / top_n})
    return rows
