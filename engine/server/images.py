"""Images and videos in API requests: the parts that carry them (OpenAI `image_url`, Responses `input_image`,
Anthropic `image` blocks; OpenAI chat `video_url`, as vLLM and Qwen's own servers take it: neither OpenAI API
defines a video part) read into bytes, with the part's place for errors; the message text gets an IMAGE_SLOT (a
VIDEO_SLOT) where each was, which the prompt's encoding makes the chat template's vision marker (Qwen's, whatever
the template: it sees a string); vision tokens a client writes as text stay text.

An http(s) image or video URL is fetched only where the server was started to (`ServerSettings.image_urls`): a
server that fetches what clients name can be made to reach whatever its host reaches. Then it reaches public
addresses only (each connection, redirects' too, checks the address it dials; `image_urls_private` lifts that), no
proxy, one deadline for the whole fetch, and a body over the engine's `image_max_mib` (`video_max_mib`) is cut off
and refused. Fetch errors say that the URL could not be fetched, not what the socket saw (that would map the
server's network).
"""
from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UserError
from ..media import IMAGE_SLOT, VIDEO_SLOT
from .errors import bad_request

__all__ = ["IMAGE_SLOT", "VIDEO_SLOT", "VideoSource", "decoded", "image_source", "ready_images", "video_source"]
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp")
VIDEO_TYPES = ("video/mp4", "video/quicktime", "video/webm", "video/x-matroska", "video/x-msvideo")
# what clients write beside the registered name
ALIASES = {"image/jpg": "image/jpeg", "video/avi": "video/x-msvideo", "video/mkv": "video/x-matroska"}
FETCH_TIMEOUT_S = 10.0  # the whole fetch: connecting, the headers, the body
READ_TIMEOUT_S = 5.0  # one wait on the socket: the deadline is checked between reads
CHUNK = 1 << 16

@dataclass(frozen=True)
class VideoSource:
    """A video part's bytes, or the http(s) URL to fetch them from."""

    data: bytes | str


# A request's image or video: where it is in the request, and its bytes or the http(s) URL to fetch them from.
ImagePart = tuple[str, bytes | str | VideoSource]


def image_source(url, where: str, param: str, kind: str = "image") -> bytes | str:
    """The bytes of a `data:image/...;base64,` URL (`data:video/...` for a video; parameters such as charset=
    allowed), or an http(s) URL as it is (`ready_images` fetches it)."""
    if not isinstance(url, str):
        raise bad_request(f"{where}: the {kind} URL must be a string", param=param)
    if url.startswith(("http://", "https://")):
        return url
    head, sep, data = url.partition(",")
    fields = [f.strip() for f in head.split(";")]
    if not (sep and fields[0][:5].lower() == "data:" and fields[-1].lower() == "base64"):
        example = "data:image/png;base64,..." if kind == "image" else "data:video/mp4;base64,..."
        raise bad_request(f"{where}: the {kind} URL must be a data: URL ({example}) or an http(s) URL", param=param)
    return decoded(data, fields[0][5:], where, param, kind)


def video_source(url, where: str, param: str) -> VideoSource:
    """A `video_url` part's video: the bytes of a `data:video/...;base64,` URL, or an http(s) URL."""
    return VideoSource(image_source(url, where, param, "video"))


def decoded(data, media_type, where: str, param: str | None = None, kind: str = "image") -> bytes:
    """Base64 image (video) data, line breaks allowed, of a declared image (video) type; the decoder tells the type
    from the bytes, whichever of the taken ones was declared."""
    taken = MEDIA_TYPES if kind == "image" else VIDEO_TYPES
    named = media_type.lower() if isinstance(media_type, str) else media_type
    if ALIASES.get(named, named) not in taken:
        raise bad_request(f"{where}: {kind} media type {media_type!r} is not supported (one of "
                          f"{', '.join(taken)})", param=param)
    if not isinstance(data, str):
        raise bad_request(f"{where}: the {kind} data must be a base64 string", param=param)
    try:
        return base64.b64decode(re.sub(r"\s+", "", data), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: the {kind} data is not valid base64", param=param) from None


def ready_images(engine, parts: list[ImagePart], settings, param: str | None = None) -> list:
    """The engine's images and videos of a request's parts (fetched where the server allows it, decoded, checked
    against the engine's bounds, in order; each video sampled within the frames the request has left);
    `make_job` encodes them once the request is known to fit."""
    if not parts:
        return []
    c = engine.config

    def file(where: str, data) -> tuple[str, bytes | Callable[[], bytes], bool]:
        """A part's bytes, or for an URL its fetch: made only once the parts before it are ready (and the request's
        count of images taken)."""
        video = isinstance(data, VideoSource)
        source, limit, kind = (data.data, c.video_max_mib, "video") if video else (data, c.image_max_mib, "image")
        if isinstance(source, str):  # an http(s) URL
            return where, lambda: fetched(source, where, settings, limit << 20, param, kind), video
        return where, source, video

    try:
        return engine.media([file(where, data) for where, data in parts])
    except UserError as exc:
        raise bad_request(str(exc), param=param) from None


def fetched(url: str, where: str, settings, limit: int, param: str | None, kind: str = "image") -> bytes:
    """An http(s) image (video) URL's body, at most `limit` bytes, within FETCH_TIMEOUT_S."""
    if not settings.image_urls:
        raise bad_request(f"{where}: this server does not fetch {kind} URLs; send the {kind} inline (base64)",
                          param=param, code=f"unsupported_{kind}_url")
    deadline = time.monotonic() + FETCH_TIMEOUT_S
    data = bytearray()
    try:
        with _opener(settings.image_urls_private).open(
                urllib.request.Request(url, headers={"User-Agent": "ninfer"}), timeout=READ_TIMEOUT_S) as resp:
            while len(data) <= limit:
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunk = resp.read1(CHUNK)
                if not chunk:
                    break
                data += chunk
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, _NotPublic):
            raise bad_request(f"{where}: the {kind} URL names a local or private address, which this server does "
                              f"not fetch; send the {kind} inline (base64)", param=param) from None
        raise _unfetched(where, param, kind) from None
    except (OSError, ValueError, http.client.HTTPException):
        raise _unfetched(where, param, kind) from None
    if len(data) > limit:
        raise bad_request(f"{where}: the {kind} at the URL is more than the {limit >> 20} MiB "
                          f"{'an' if kind == 'image' else 'a'} {kind} may be", param=param)
    return bytes(data)


def _unfetched(where: str, param: str | None, kind: str):
    return bad_request(f"{where}: the {kind} URL could not be fetched (an error, or more than "
                       f"{FETCH_TIMEOUT_S:.0f} s)", param=param)


class _NotPublic(OSError):
    """A connection refused before it was made: the address is not a global one."""


def _dial(private: bool):
    """socket.create_connection for http.client, to the host's addresses that are public (all of them with
    `private`): checked at the connection itself, so a redirect or a name that resolves anew is checked too."""
    def dial(address, timeout=socket._GLOBAL_DEFAULT_TIMEOUT, source_address=None):
        host, port = address
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        allowed = [i for i in infos if private or _public(i[4][0])]
        if not allowed:
            raise _NotPublic(f"{host} is not a public address")
        family, kind, proto, _, addr = allowed[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(addr)
        except BaseException:
            sock.close()
            raise
        return sock
    return dial


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%")[0])  # an IPv6 zone names an interface
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is loopback
    return ip.is_global


def _opener(private: bool) -> urllib.request.OpenerDirector:
    """An opener whose every connection dials through `_dial`, http(s) redirects only, and no proxy (which would
    dial for it)."""
    dial = _dial(private)

    class Http(http.client.HTTPConnection):
        def connect(self):
            self._create_connection = dial  # http.client sets socket.create_connection on each connection
            super().connect()

    class Https(http.client.HTTPSConnection):
        def connect(self):
            self._create_connection = dial
            super().connect()

    class HttpHandler(urllib.request.HTTPHandler):
        def http_open(self, req):
            return self.do_open(Http, req)

    class HttpsHandler(urllib.request.HTTPSHandler):
        def https_open(self, req):
            return self.do_open(Https, req)

    return urllib.request.build_opener(urllib.request.ProxyHandler({}), HttpHandler, HttpsHandler, _HttpRedirects)


class _HttpRedirects(urllib.request.HTTPRedirectHandler):
    """Redirects to http(s) URLs only (urllib would follow one to ftp:)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not newurl.startswith(("http://", "https://")):
            raise urllib.error.URLError(f"a redirect to {newurl.split(':', 1)[0]}: is not followed")
        return super().redirect_request(req, fp, code, msg, headers, newurl)
