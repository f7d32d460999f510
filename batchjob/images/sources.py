"""A row's images, read from where the row names them: an OpenAI `image_url` part's url (a `data:` URI, a local path or
`file://` URL, an `http(s)://` URL), an image column's value (bytes, a path, or the `{bytes, path}` struct that Hugging
Face `datasets` writes for its Image feature), or a PIL image given to the Python API. Each becomes an ImageInput: the
decoded RGB picture's source bytes and their SHA-256 (what prefix-cache keys use: the same image by any route is the
same image). Anything that cannot be read or decoded is an ImageError naming the part
and why; the job fails that row alone."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

FETCH_WORKERS = 8  # http(s) images of a batch of rows fetched at once
MAX_IMAGE_BYTES = 20 << 20  # an http(s) image larger than this fails its row (vLLM's media connector has no cap)
HTTP_TIMEOUT_S = 10.0
MAX_PIXELS = 64 << 20  # a decoded image of more pixels fails its row (Pillow's decompression-bomb guard is 89M)


class ImageError(ValueError):
    """A row's image that cannot be used; the message names the part and what to do."""


Fetched = Mapping[str, "bytes | ImageError"]  # http(s) url -> its bytes, or why its fetch failed


@dataclass(frozen=True, slots=True)
class ImageInput:
    image: Image.Image  # decoded, RGB (transparency composited onto white later, by the processor as transformers does)
    digest: str  # SHA-256 hex of the source bytes (of the pixels, for a PIL image given in memory)
    origin: str  # where it came from, for messages: "data: URI", a path, a url, "bytes", "PIL image"

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+>")


def from_bytes(data: bytes, origin: str) -> ImageInput:
    """Decode an encoded image (PNG, JPEG, WebP, GIF: its first frame, ...)."""
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_PIXELS:
            raise ImageError(f"{origin}: {img.width} x {img.height} pixels is more than {MAX_PIXELS:,}")
        img.seek(0)  # an animation's first frame
        img.load()
    except ImageError:
        raise
    except UnidentifiedImageError:  # PIL's text names the BytesIO object by its address: another each run
        raise ImageError(f"{origin}: does not decode as an image (PIL cannot identify it: not an image, a damaged one "
                         f"or a format PIL does not read; {len(data):,} bytes starting {data[:8]!r})") from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{origin}: does not decode as an image ({type(e).__name__}: {_no_address(str(e))})") from None
    return ImageInput(img, hashlib.sha256(data).hexdigest(), origin)


def _no_address(text: str) -> str:
    """An error's text without an object's memory address (`<_io.BytesIO object at 0x7f...>` -> `<_io.BytesIO
    object>`): a row's error is the same on every run."""
    return _ADDRESS.sub(">", text)


def from_pil(img: Image.Image) -> ImageInput:
    """A PIL image given in memory (the Python API): its digest is over its mode, size and pixels."""
    img.load()
    h = hashlib.sha256(f"{img.mode} {img.width}x{img.height}\0".encode())
    h.update(img.tobytes())
    return ImageInput(img, h.hexdigest(), "PIL image")


def from_path(path: str | Path, base: Path | None) -> ImageInput:
    """A local file; a relative path resolves against `base` (the input file's folder)."""
    p = Path(path).expanduser()
    if not p.is_absolute() and base is not None:
        p = base / p
    try:
        data = p.read_bytes()
    except OSError as e:
        hint = f" (a relative path resolves against {base})" if base is not None and not Path(path).is_absolute() else ""
        raise ImageError(f"{path}: cannot read the image file: {e.strerror or e}{hint}") from None
    return from_bytes(data, str(p))


def fetch_many(urls: Iterable, timeout: float = HTTP_TIMEOUT_S, max_bytes: int = MAX_IMAGE_BYTES) -> Fetched:
    """The http(s) urls among `urls` fetched several at a time (FETCH_WORKERS): each one's bytes, or the ImageError
    its fetch failed with (the row that names it fails alone). Other values are left out."""
    todo = list(dict.fromkeys(u for u in urls if isinstance(u, str) and _scheme(u) in ("http", "https")))
    if not todo:
        return {}

    def one(url: str) -> bytes | ImageError:
        try:
            return _fetch(url, timeout, max_bytes)
        except ImageError as e:
            return e

    with ThreadPoolExecutor(min(FETCH_WORKERS, len(todo)), thread_name_prefix="batchjob-fetch") as pool:
        return dict(zip(todo, pool.map(one, todo)))


def from_url(url: str, base: Path | None = None, timeout: float = HTTP_TIMEOUT_S,
             max_bytes: int = MAX_IMAGE_BYTES, fetched: Fetched | None = None) -> ImageInput:
    """An OpenAI `image_url` url: `data:image/...;base64,...`, `file://...`, `http(s)://...`, or a plain path.
    `fetched`: http(s) urls fetched already (fetch_many); another is fetched here."""
    if not isinstance(url, str) or not url:
        raise ImageError(f"image_url.url: expected a non-empty string, got {url!r:.60}")
    scheme = _scheme(url)
    if scheme == "data":
        return from_bytes(_data_uri(url), "data: URI")
    if scheme == "file":
        parsed = urllib.parse.urlparse(url)
        return from_path(urllib.parse.unquote(parsed.path), base)
    if scheme in ("http", "https"):
        got = fetched.get(url) if fetched else None
        if isinstance(got, ImageError):
            raise got
        return from_bytes(got if got is not None else _fetch(url, timeout, max_bytes), url)
    if scheme and len(scheme) > 1:  # "c:" is a Windows drive, not a scheme
        raise ImageError(f"{url:.80}: unsupported url scheme {scheme!r}; use a data: URI, a path, file:// or http(s)://")
    return from_path(url, base)


def from_column(value, base: Path | None, fetched: Fetched | None = None) -> list[ImageInput]:
    """An image column's value: bytes, a path, the `{bytes, path}` struct of a `datasets` Image feature, or a list
    of any of them (None: no image)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [img for v in value for img in from_column(v, base, fetched)]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [from_bytes(bytes(value), "bytes")]
    if isinstance(value, str):
        return [from_url(value, base, fetched=fetched)]
    if isinstance(value, dict) and set(value) <= {"bytes", "path"}:
        if value.get("bytes") is not None:
            return [from_bytes(bytes(value["bytes"]), value.get("path") or "bytes")]
        if value.get("path"):
            return [from_path(value["path"], base)]
        return []
    if isinstance(value, Image.Image):
        return [from_pil(value)]
    raise ImageError(f"expected bytes, a path or url, a {{bytes, path}} struct or a list of them, got "
                     f"{type(value).__name__}")


def column_count(value) -> int:
    """How many images an image column's value holds, without reading them (the chat template needs the count
    before the images are read)."""
    if value is None:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(column_count(v) for v in value)
    if isinstance(value, dict) and value.get("bytes") is None and not value.get("path"):
        return 0
    return 1


def _scheme(url: str) -> str:
    return url.split(":", 1)[0].lower() if ":" in url[:12] else ""


def _data_uri(url: str) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("data: URI: no ',' before the data")
    if not head.lower().endswith(";base64"):
        raise ImageError(f"data: URI: only base64 data is supported ({head[:40]!r}); write data:image/png;base64,...")
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"data: URI: not valid base64 ({e})") from None


def _fetch(url: str, timeout: float, max_bytes: int) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "batchjob"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise ImageError(f"{url}: {int(length):,} bytes is more than the {max_bytes:,} bytes an image may have")
            data = r.read(max_bytes + 1)
    except ImageError:
        raise
    except urllib.error.HTTPError as e:
        raise ImageError(f"{url}: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise ImageError(f"{url}: unreachable ({reason})") from None
    if len(data) > max_bytes:
        raise ImageError(f"{url}: more than the {max_bytes:,} bytes an image may have")
    return data
