"""zmq CURVE certificates (`zmq.auth.create_certificates` writes them): the daemon's and a
client's key pairs, whose files must be private, and a daemon's public key.

One reader for both sides, so a key file is judged alike wherever it is used.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Final

from engined.config.api_keys import read_private
from engined.zmq_sockets import CurveClientKeys

# `public-key = "..."` / `secret-key = "..."` lines of a certificate (ZPL); Z85 is printable.
_KEY_LINE: Final = r'^\s*{name}\s*=\s*"([!-~]{{40}})"\s*$'
_PUBLIC: Final = re.compile(_KEY_LINE.format(name="public-key"), re.M)
_SECRET: Final = re.compile(_KEY_LINE.format(name="secret-key"), re.M)


def read_key_pair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys of a certificate only its owner (and group) may read.

    Raises:
        ValueError: why the file cannot be used, naming it.
    """
    try:
        text = read_private(str(path)).decode("utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    secret = _SECRET.search(text)
    if secret is None:
        raise ValueError(f'{path}: no secret-key = "<40 Z85 characters>"')
    public = _PUBLIC.search(text)
    if public is None:
        raise ValueError(f'{path}: no public-key = "<40 Z85 characters>"')
    return public.group(1).encode(), secret.group(1).encode()


def read_public_key(path: Path) -> bytes:
    """The Z85 public key of a certificate (its public half may be shared freely).

    Raises:
        ValueError: why the file cannot be used, naming it.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    public = _PUBLIC.search(text)
    if public is None:
        raise ValueError(f'{path}: no public-key = "<40 Z85 characters>"')
    return public.group(1).encode()


# A client's CURVE keys, for every `engined` client (the tools, the Dynamo worker, scripts)
# that talks to a daemon with `curve_secret_key_file`.
CLIENT_KEY_FILE_ENV: Final = "ENGINED_CURVE_CLIENT_KEY_FILE"
SERVER_KEY_FILE_ENV: Final = "ENGINED_CURVE_SERVER_KEY_FILE"


def client_keys_from_environment() -> CurveClientKeys | None:
    """The keys named by ENGINED_CURVE_CLIENT_KEY_FILE (this client's certificate, private)
    and ENGINED_CURVE_SERVER_KEY_FILE (the daemon's public certificate); None when neither
    is set.

    Raises:
        ValueError: only one is set, or a file cannot be used (naming it).
    """
    client_file = os.environ.get(CLIENT_KEY_FILE_ENV, "")
    server_file = os.environ.get(SERVER_KEY_FILE_ENV, "")
    if not client_file and not server_file:
        return None
    if not (client_file and server_file):
        raise ValueError(f"CURVE needs both {CLIENT_KEY_FILE_ENV} and {SERVER_KEY_FILE_ENV}")
    public, secret = read_key_pair(Path(client_file))
    return {
        "public_key": public,
        "secret_key": secret,
        "server_key": read_public_key(Path(server_file)),
    }
