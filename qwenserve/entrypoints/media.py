"""The media a content part points at, as a decoded PIL image: a data: URL decoded, an http(s) URL fetched (only
from --allowed-media-domains, within a timeout and a size limit, every redirect checked again), a file:// URL read
(only under --allowed-local-media-path). Everything here blocks: the server calls it in a thread. Every refusal is
a RequestError whose param is the content part (e.g. messages[0].content[1]) and whose message names the flag or
the problem."""
from __future__ import annotations

import base64
import binascii
import io
import os
import time
import urllib.error
import urllib.parse
import urllib.request

from qwenserve.config.engine_config import MultiModalConfig
from qwenserve.config.errors import RequestError

# PIL opens many more formats; some (EPS, PDF) run external programs, so only the web's image formats are read
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
CHUNK = 64 * 1024


class MediaConnector:
    def __init__(self, allowed_domains: list[str] | None = None, allowed_local_path: str | None = None,
                 timeout: float = 5.0, max_bytes: int = 20 << 20):
        self.allowed_domains = {d.lower() for d in allowed_domains or ()}
        self.allowed_local_path = os.path.realpath(allowed_local_path) if allowed_local_path else None
        self.timeout = timeout
        self.max_bytes = max_bytes

    @classmethod
    def from_config(cls, config: MultiModalConfig) -> MediaConnector:
        return cls(config.allowed_media_domains, config.allowed_local_media_path, config.media_fetch_timeout,
                   config.max_media_bytes)

    def load_image(self, source, where: str):
        """A PIL image (decoded and loaded) from a PIL image, a data:, http(s):// or file:// URL, or bytes."""
        from PIL import Image
        if isinstance(source, Image.Image):
            return source
        if isinstance(source, str):
            source = self.load_bytes(source, where, "image")
        if not isinstance(source, (bytes, bytearray)):
            raise RequestError(f"{where}: an image must be a URL string (data:, http(s)://, file://) or a PIL image, "
                               f"got {type(source).__name__}", param=where)
        return decode_image(bytes(source), where)

    def load_bytes(self, url: str, where: str, kind: str = "image") -> bytes:
        """The bytes a URL holds; kind: what the part must hold ("image"), checked against a data: URL's media
        type and a response's Content-Type."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return self._data_url(url, where, kind)
        if scheme in ("http", "https"):
            return self._fetch(url, where, kind)
        if scheme == "file":
            return self._read_file(url, where)
        raise RequestError(f"{where}: a media URL must be data:, http(s):// or file://, got one starting "
                           f"{url[:30]!r}", param=where)

    def _data_url(self, url: str, where: str, kind: str) -> bytes:
        header, comma, payload = url.partition(",")
        media_type = header[len("data:"):].split(";")[0].lower()
        if not comma or not header.endswith(";base64"):
            raise RequestError(f"{where}: a data: URL must be base64, as data:image/png;base64,...", param=where)
        _check_media_type(media_type, where, kind)
        if len(payload) * 3 // 4 > self.max_bytes:
            raise RequestError(f"{where}: the data: URL holds more than {self.max_bytes} bytes (--max-media-bytes)",
                               param=where)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(f"{where}: the data: URL holds invalid base64", param=where) from None

    def _check_host(self, url: str, where: str) -> None:
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if host not in self.allowed_domains:
            allowed = ", ".join(sorted(self.allowed_domains)) or "none"
            raise RequestError(f"{where}: the media URL's host {host!r} is not allowed (--allowed-media-domains: "
                               f"{allowed})", param=where)

    def _fetch(self, url: str, where: str, kind: str) -> bytes:
        self._check_host(url, where)
        connector = self

        class CheckedRedirects(urllib.request.HTTPRedirectHandler):
            def redirect_request(self, req, fp, code, msg, headers, newurl):
                if urllib.parse.urlsplit(newurl).scheme.lower() not in ("http", "https"):
                    raise RequestError(f"{where}: the media URL redirects to a non-http(s) URL", param=where)
                connector._check_host(newurl, where)  # a redirect may not lead off the allowed hosts
                return super().redirect_request(req, fp, code, msg, headers, newurl)

        opener = urllib.request.build_opener(CheckedRedirects)
        deadline = time.monotonic() + self.timeout
        try:
            with opener.open(urllib.request.Request(url, headers={"User-Agent": "qwenserve"}),
                             timeout=self.timeout) as response:
                content_type = response.headers.get_content_type()
                if content_type != "application/octet-stream":  # what servers say when they do not know
                    _check_media_type(content_type, where, kind)
                length = response.headers.get("Content-Length")
                if length is not None and length.isdigit() and int(length) > self.max_bytes:
                    raise self._too_large(where)
                data = bytearray()
                while chunk := response.read(CHUNK):
                    data += chunk
                    if len(data) > self.max_bytes:
                        raise self._too_large(where)
                    if time.monotonic() > deadline:  # the socket timeout bounds each read, this the whole body
                        raise TimeoutError
                return bytes(data)
        except RequestError:
            raise
        except urllib.error.HTTPError as e:
            raise RequestError(f"{where}: fetching the media URL failed: HTTP {e.code}", param=where) from None
        except (TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(e, TimeoutError) or isinstance(reason, TimeoutError):
                message = f"took longer than {self.timeout:g} s (--media-fetch-timeout)"
            else:
                message = f"failed: {reason}"
            raise RequestError(f"{where}: fetching the media URL {message}", param=where) from None

    def _read_file(self, url: str, where: str) -> bytes:
        if self.allowed_local_path is None:
            raise RequestError(f"{where}: file:// URLs are refused: this server reads no local files "
                               f"(--allowed-local-media-path)", param=where)
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise RequestError(f"{where}: a file:// URL names no host (file:///path), got {parts.netloc!r}",
                               param=where)
        path = os.path.realpath(urllib.parse.unquote(parts.path))  # links resolved: none leads out of the folder
        if os.path.commonpath([path, self.allowed_local_path]) != self.allowed_local_path:
            raise RequestError(f"{where}: the file is outside the directory --allowed-local-media-path allows",
                               param=where)
        try:
            if os.path.getsize(path) > self.max_bytes:
                raise self._too_large(where)
            with open(path, "rb") as f:
                return f.read(self.max_bytes + 1)
        except OSError as e:
            raise RequestError(f"{where}: the file cannot be read ({e.strerror})", param=where) from None

    def _too_large(self, where: str) -> RequestError:
        return RequestError(f"{where}: the media is larger than {self.max_bytes} bytes (--max-media-bytes)",
                            param=where)


def _check_media_type(media_type: str, where: str, kind: str) -> None:
    if kind == "image" and media_type.startswith("video/"):
        raise RequestError(f"{where}: {media_type} is a video; an image part needs an image", param=where)
    if not media_type.startswith(f"{kind}/"):
        raise RequestError(f"{where}: unsupported media type {media_type or '(none)'!r}; this part needs "
                           f"{kind}/*", param=where)


def decode_image(data: bytes, where: str):
    """The image the bytes encode, loaded (so a truncated file fails here, not in the engine)."""
    from PIL import Image, UnidentifiedImageError
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        image.load()
        return image
    except UnidentifiedImageError:
        raise RequestError(f"{where}: the data is not an image in a supported format "
                           f"({', '.join(IMAGE_FORMATS)})", param=where) from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise RequestError(f"{where}: the image cannot be decoded: {e}", param=where) from None
