"""The training corpus: Python source that every machine with Python already has.

The standard library's ``.py`` files are the portable part; installed packages (site-packages) can
be added behind a flag where more text is wanted. Everything here is deterministic: paths are
sorted, the held-out split is a stable hash of each file's path relative to its root (so a path is
held out on every machine and Python version), and a digest of the exact text used is recorded.
"""

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# Folders inside a stdlib tree that are not the standard library (pyenv and source builds keep
# site-packages under lib/pythonX.Y).
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# Larger files are generated tables and data (e.g. pydoc_data/topics.py), not code worth learning.
DEFAULT_MAX_FILE_BYTES = 300_000
# One document in this many is wrapped as a ChatML exchange, so the chat template leads to code.
CHAT_WRAP_ONE_IN = 8


@dataclass(frozen=True)
class SourceFile:
    root_name: str  # "stdlib" or "site-packages"
    rel_path: str  # POSIX path relative to the root
    text: str


@dataclass(frozen=True)
class Corpus:
    train: list[SourceFile]
    heldout: list[SourceFile]
    manifest: dict


def stable_fraction(key: str) -> float:
    """A number in [0, 1) fixed by ``key`` alone (Python's hash() is salted per process)."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(rel_path: str, heldout_fraction: float) -> bool:
    return stable_fraction("heldout:" + rel_path) < heldout_fraction


def source_roots(include_site_packages: bool) -> list[tuple[str, Path]]:
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]))]
    if include_site_packages:
        for key in ("purelib", "platlib"):
            root = Path(paths[key])
            if root.is_dir() and all(root != existing for _, existing in roots):
                roots.append(("site-packages", root))
    return roots


def python_files(root: Path) -> list[Path]:
    found = []
    for dir_path, dir_names, file_names in os.walk(root):
        dir_names[:] = [d for d in dir_names if d not in _SKIPPED_DIRS]
        found.extend(Path(dir_path) / f for f in file_names if f.endswith(".py"))
    return sorted(found)


def read_source(path: Path, max_file_bytes: int) -> str | None:
    """The file's text, or None for files that are not usable training text."""
    try:
        if path.stat().st_size > max_file_bytes:
            return None
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # the stdlib's tests ship deliberately mis-encoded files; links can dangle
    if not text.strip() or any(token in text for token in SPECIAL_TOKENS):
        return None  # a literal special token would teach the model to end mid-string
    return text


def collect_corpus(
    include_site_packages: bool = False,
    heldout_fraction: float = 0.03,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> Corpus:
    """Read the corpus and split it; ``manifest`` records what was used and a digest of it."""
    train: list[SourceFile] = []
    heldout: list[SourceFile] = []
    digest = hashlib.sha256()
    skipped = 0
    for root_name, root in source_roots(include_site_packages):
        for path in python_files(root):
            text = read_source(path, max_file_bytes)
            if text is None:
                skipped += 1
                continue
            rel_path = path.relative_to(root).as_posix()
            source = SourceFile(root_name, rel_path, text)
            digest.update(f"{root_name}/{rel_path}\0{text}\0".encode("utf-8"))
            (heldout if is_heldout(rel_path, heldout_fraction) else train).append(source)
    manifest = {
        "python_version": sys.version.split()[0],
        "roots": {name: str(root) for name, root in source_roots(include_site_packages)},
        "include_site_packages": include_site_packages,
        "heldout_fraction": heldout_fraction,
        "max_file_bytes": max_file_bytes,
        "train_files": len(train),
        "heldout_files": len(heldout),
        "skipped_files": skipped,
        "train_bytes": sum(len(f.text.encode("utf-8")) for f in train),
        "heldout_bytes": sum(len(f.text.encode("utf-8")) for f in heldout),
        "sha256": digest.hexdigest(),
    }
    return Corpus(train, heldout, manifest)


def chat_prompt(rel_path: str) -> str:
    return f"Write the Python module {rel_path}."


def format_document(source: SourceFile) -> str:
    """The text the models see for one file: the source itself, or (for a stable subset) the
    source as the assistant's answer in a ChatML exchange, as the shipped chat template renders it."""
    if stable_fraction("chat:" + source.rel_path) * CHAT_WRAP_ONE_IN >= 1:
        return source.text
    return (
        f"{IM_START_TOKEN}user\n{chat_prompt(source.rel_path)}{IM_END_TOKEN}\n"
        f"{IM_START_TOKEN}assistant\n{source.text}{IM_END_TOKEN}\n"
    )
