"""Build the offline three-domain corpus the embedded MoE is trained on.

Italian comes from Debian's `fortunes-it`, English from `fortunes`/`fortunes-min`, Python from
the running interpreter's standard library. Everything is local, so the corpus (and with it the
shipped model) can be rebuilt without a network; the held-out split is by document and seeded.

    apt-get install -y fortunes-it fortunes
    python scripts/build_corpus.py --out /tmp/embedded-work/corpus
"""

import random
import subprocess
import sysconfig
from pathlib import Path

import click

DOC_SEPARATOR = "\n\x1e\n"  # record separator: one document per record in the output files
SKIP_SUFFIXES = (".dat", ".u8", ".gz")
SKIP_FORTUNE_NAMES = {"ascii-art", "art", "banner"}  # pictures, not language


def package_files(package: str) -> list[Path]:
    """Files a Debian package installed, via `dpkg -L` (so we never guess install paths)."""
    out = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, check=True)
    return [Path(line) for line in out.stdout.splitlines() if line.strip()]


def fortune_files(packages: list[str], exclude_dir: str | None) -> list[Path]:
    """Plain-text fortune files of `packages`, minus index files, offensive folders and art."""
    found = set()
    for package in packages:
        for path in package_files(package):
            if "/games/fortunes" not in str(path) or not path.is_file():
                continue
            real = path.resolve()
            parts = set(real.parts)
            if real.suffix in SKIP_SUFFIXES or "off" in parts or real.name in SKIP_FORTUNE_NAMES:
                continue
            if exclude_dir and exclude_dir in parts:
                continue
            found.add(real)
    return sorted(found)


def decode(raw: bytes) -> str:
    """UTF-8 if it is valid, else latin-1: a few old fortune files predate UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def split_fortunes(text: str) -> list[str]:
    """Fortunes are separated by lines holding a single `%`."""
    docs, current = [], []
    for line in text.splitlines():
        if line.strip() == "%":
            docs.append("\n".join(current).strip())
            current = []
        else:
            current.append(line.rstrip())
    docs.append("\n".join(current).strip())
    return [d for d in docs if len(d) >= 20]


def read_fortunes(files: list[Path]) -> list[str]:
    """All fortunes of all files, de-duplicated, in file order."""
    seen, docs = set(), []
    for path in files:
        for doc in split_fortunes(decode(path.read_bytes())):
            if doc not in seen:
                seen.add(doc)
                docs.append(doc)
    return docs


def read_python_sources(cap_bytes: int, seed: int) -> list[str]:
    """Standard-library modules (no tests), shuffled with `seed`, until `cap_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p for p in root.rglob("*.py")
        if not {"test", "tests", "idle_test", "site-packages"} & set(p.relative_to(root).parts)
    )
    random.Random(seed).shuffle(paths)
    docs, total = [], 0
    for path in paths:
        text = decode(path.read_bytes()).strip()
        if not text or total + len(text) > cap_bytes:
            continue
        docs.append(text)
        total += len(text)
    return docs


def split_heldout(docs: list[str], fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Seeded split by document, so no held-out text is ever seen in training."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    n_heldout = max(1, round(len(docs) * fraction))
    held = set(order[:n_heldout])
    train = [d for i, d in enumerate(docs) if i not in held]
    heldout = [d for i, d in enumerate(docs) if i in held]
    return train, heldout


def write_split(out: Path, domain: str, name: str, docs: list[str]) -> int:
    """Write one split; returns its size in bytes."""
    path = out / domain / f"{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(DOC_SEPARATOR.join(docs), encoding="utf-8")
    return path.stat().st_size


def read_split(path: Path) -> list[str]:
    """Inverse of `write_split`."""
    return path.read_text(encoding="utf-8").split(DOC_SEPARATOR)


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("/tmp/embedded-work/corpus"))
@click.option("--seed", type=int, default=0)
@click.option("--heldout-fraction", type=float, default=0.05)
@click.option("--python-cap-mb", type=float, default=4.0, help="cap on stdlib source size")
def main(out: Path, seed: int, heldout_fraction: float, python_cap_mb: float) -> None:
    """Write {out}/{italian,english,python}/{train,heldout}.txt and print their sizes."""
    domains = {
        "italian": read_fortunes(fortune_files(["fortunes-it"], None)),
        "english": read_fortunes(fortune_files(["fortunes", "fortunes-min"], "it")),
        "python": read_python_sources(int(python_cap_mb * 1e6), seed),
    }
    for domain, docs in domains.items():
        train, heldout = split_heldout(docs, heldout_fraction, seed)
        train_bytes = write_split(out, domain, "train", train)
        heldout_bytes = write_split(out, domain, "heldout", heldout)
        click.echo(
            f"{domain:8s} docs={len(docs):6d} train={train_bytes / 1e6:6.2f} MB "
            f"heldout={heldout_bytes / 1e3:7.1f} KB ({len(heldout)} docs)"
        )


if __name__ == "__main__":
    main()
