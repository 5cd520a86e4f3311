"""Models named by a Hugging Face Hub id ("ORG/NAME"), read from the Hub's local cache layout
(models--ORG--NAME/{blobs,refs/main,snapshots/<commit>/...}).

Offline first: a model whose config is in the cache is used as it is (the snapshot refs/main
names), with no request to the Hub. What the cache lacks is fetched with hf_hub_download, one file
at a time and only when needed: the config, the shard index, the generation config and tokenizer
files when the model is resolved; a weight shard only when a span or the client side reads a
tensor from it (blocks.checkpoint.CheckpointTensors). Everything lands in the same cache, pinned to
the snapshot's commit, so a daemon never mixes files of two revisions.
"""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path
from urllib.parse import urlsplit

from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)

from blocks.errors import ModelNotFoundError

# What the Hub accepts as ORG/NAME (no "--", which the cache layout uses as its separator).
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}")
COMMIT = re.compile(r"[0-9a-f]{40}")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
# Small files a model may have: fetched (when missing) with the config, skipped when it has none.
OPTIONAL_FILES = ("generation_config.json", *TOKENIZER_FILES)
_TRUE = {"1", "on", "yes", "true"}
PROBE_TTL = 30.0  # seconds a reachability probe's answer is reused (a model's files in a row)
_probes: dict[str, tuple[float, str | None]] = {}


def is_hub_id(model: str) -> bool:
    """Whether `model` has the shape of a Hub repository id, ORG/NAME."""
    return bool(HUB_ID.fullmatch(model)) and "--" not in model and ".." not in model


def hub_cache_dir() -> Path:
    """The Hub cache as huggingface_hub finds it: $HF_HUB_CACHE, else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub (read now, not at import)."""
    if explicit := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(explicit).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def offline() -> bool:
    """HF_HUB_OFFLINE set: the Hub is never asked, only the cache is read."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def snapshot_dir(repo_id: str, weight_files: tuple[str, str]) -> Path:
    """The cached snapshot of `repo_id` (refs/main), with its config, small files and the weight
    index (`weight_files`: the index, else the single weights file) in it, fetched if missing."""
    cache = hub_cache_dir()
    cached = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    if isinstance(cached, str):
        snapshot = Path(cached).parent
    else:
        snapshot = Path(_download(repo_id, "config.json", None, cache)).parent
    # A cached model is used as it is; one with no tokenizer yet gets its small files now.
    if not any((snapshot / name).is_file() for name in TOKENIZER_FILES[:2]):
        for name in OPTIONAL_FILES:
            fetch(snapshot, name, required=False)
    index, single = weight_files
    has_weights = (snapshot / index).is_file() or (snapshot / single).is_file()
    if not has_weights and fetch(snapshot, index, required=False) is None:
        fetch(snapshot, single, also=index)
    return snapshot


def snapshot_repo(path: Path) -> tuple[str, str, Path] | None:
    """(repo id, commit, cache directory) of a Hub-cache snapshot directory; None for any other."""
    snapshots = path.parent
    repo = snapshots.parent.name
    if snapshots.name != "snapshots" or not repo.startswith("models--"):
        return None
    parts = repo.removeprefix("models--").split("--")
    if len(parts) != 2 or not COMMIT.fullmatch(path.name):
        return None
    return "/".join(parts), path.name, snapshots.parent.parent


def fetch(snapshot: Path, filename: str, *, required: bool = True, also: str = "") -> Path | None:
    """`filename` of a Hub-cache snapshot: the cached file, else downloaded into the cache.

    A file the repository does not have, or that cannot be fetched now (offline, no network), is
    None when not `required`; when required, ModelNotFoundError in one line naming it (and the
    alternative `also`, if the caller would have taken that instead).
    """
    if (snapshot / filename).is_file():
        return snapshot / filename
    repo = snapshot_repo(snapshot)
    if repo is None:
        if not required:
            return None
        raise ModelNotFoundError(f"{snapshot} has no {filename}: the checkpoint is incomplete")
    repo_id, commit, cache = repo
    try:
        return Path(_download(repo_id, filename, commit, cache, also))
    except ModelNotFoundError:
        if not required:
            return None
        raise


def _download(
    repo_id: str, filename: str, revision: str | None, cache: Path, also: str = ""
) -> str:
    """hf_hub_download into `cache`, its errors as one line a person can act on (naming `also`
    as the alternative the caller looked for first). With no route to the Hub it only looks in
    the cache: huggingface_hub would retry for some 20 s per file."""
    named = f"{filename} (or {also})" if also else filename
    where = f"{named} of {repo_id}"
    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT  # read now, not at import
    unreachable = None if offline() else _unreachable(endpoint)
    try:
        path = hf_hub_download(
            repo_id,
            filename,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline() or unreachable is not None,
            endpoint=endpoint,
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        reason = "HF_HUB_OFFLINE is set" if offline() else f"there is no network ({unreachable})"
        raise ModelNotFoundError(
            f"{where} is not in the Hugging Face cache ({cache}) and {reason}: connect once to "
            "fetch it, or copy the model into that cache"
        ) from None
    except RemoteEntryNotFoundError:
        raise ModelNotFoundError(f"{repo_id} has no file {named} on the Hub") from None
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{repo_id} is gated on the Hub: accept its terms on huggingface.co and log in with "
            "`hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"no model {repo_id} on the Hugging Face Hub (a private one needs `hf auth login`)"
        ) from None
    except (HfHubHTTPError, OSError) as e:
        raise ModelNotFoundError(f"fetching {where} failed: {_first_line(e)}") from None
    return str(path)


def _unreachable(endpoint: str, timeout: float = 5.0) -> str | None:
    """Why the Hub at `endpoint` cannot be reached (one TCP connection tried, its answer reused
    for PROBE_TTL: a model's files come in a row), None if it can. Behind a proxy only the HTTP
    request can tell: None."""
    proxies = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
    if any(os.environ.get(name) for name in proxies):
        return None
    now = time.monotonic()
    if (known := _probes.get(endpoint)) is not None and now - known[0] < PROBE_TTL:
        return known[1]
    url = urlsplit(endpoint)
    host = url.hostname or ""
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        why = None
    except OSError as e:
        why = f"{host}:{port}: {e.strerror or type(e).__name__}"
    _probes[endpoint] = (now, why)
    return why


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
