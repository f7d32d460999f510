"""A row's images from every route a user names them by (data: URIs, paths relative to the input file, file://,
http(s) from a local server, bytes, the `datasets` Image struct, PIL images), and each bad case a clear error
naming the part."""
from __future__ import annotations

import base64
import hashlib
import http.server
import io
import threading
from functools import partial

import numpy as np
import pytest
from PIL import Image

from batchjob.images.sources import ImageError, from_column, from_pil, from_url


def png(w=20, h=12, seed=0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


@pytest.fixture()
def server(tmp_path):
    """A local http.server on 127.0.0.1 serving tmp_path."""
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_every_route_gives_the_same_image_and_digest(tmp_path, server):
    data = png()
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics/a.png").write_bytes(data)
    routes = [from_url(data_uri(data)), from_url("pics/a.png", base=tmp_path), from_url(f"file://{tmp_path}/pics/a.png"),
              from_url(str(tmp_path / "pics/a.png")), from_url(f"{server}/pics/a.png"),
              *from_column(data, None), *from_column({"bytes": data, "path": "a.png"}, None),
              *from_column({"bytes": None, "path": "pics/a.png"}, tmp_path), *from_column("pics/a.png", tmp_path)]
    want = hashlib.sha256(data).hexdigest()
    assert all(r.digest == want and r.size == (20, 12) for r in routes)
    assert all(np.array_equal(np.array(r.image), np.array(routes[0].image)) for r in routes)
    assert [r.digest for r in from_column([data, png(seed=1)], None)] == [want, hashlib.sha256(png(seed=1)).hexdigest()]
    assert from_column(None, None) == []


def test_a_gif_gives_its_first_frame_and_pil_images_hash_their_pixels():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    got = from_url(data_uri(buf.getvalue(), "image/gif"))
    assert got.image.convert("RGB").getpixel((0, 0)) == (255, 0, 0)
    a, b = from_pil(frames[0]), from_pil(frames[0].copy())
    assert a.digest == b.digest != from_pil(frames[1]).digest
    assert from_column(frames[1], None)[0].digest == from_pil(frames[1]).digest


def test_each_bad_image_is_an_error_naming_it(tmp_path, server):
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    (tmp_path / "big.png").write_bytes(png(400, 400))
    cases = [
        (lambda: from_url("data:image/png;base64,%%%"), "does not decode"),
        (lambda: from_url("data:image/png,rawbytes"), "only base64"),
        (lambda: from_url("missing.png", base=tmp_path), "missing.png: cannot read the image file"),
        (lambda: from_url("junk.png", base=tmp_path), "does not decode as an image"),
        (lambda: from_url(f"{server}/nothing.png"), "HTTP 404"),
        (lambda: from_url("http://127.0.0.1:9/x.png", timeout=2), "unreachable"),
        (lambda: from_url(f"{server}/big.png", max_bytes=1000), "more than the 1,000 bytes"),
        (lambda: from_url("ftp://host/x.png"), "unsupported url scheme 'ftp'"),
        (lambda: from_url(""), "non-empty string"),
        (lambda: from_column(3.5, None), "got float"),
    ]
    for call, words in cases:
        with pytest.raises(ImageError) as e:
            call()
        assert words in str(e.value), (words, str(e.value))


def test_a_batchs_http_images_are_fetched_together_and_a_failed_one_stays_its_own(tmp_path):
    """fetch_many: several requests in flight at once (the server counts them), each url's bytes or its own error;
    from_url then reads the fetched bytes (and fetches a url it was not given)."""
    from batchjob.images.sources import fetch_many

    for i in range(6):
        (tmp_path / f"{i}.png").write_bytes(png(seed=i))
    seen = {"now": 0, "most": 0}
    lock = threading.Lock()

    class Slow(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            with lock:
                seen["now"] += 1
                seen["most"] = max(seen["most"], seen["now"])
            threading.Event().wait(0.2)  # long enough for the other requests to arrive
            try:
                super().do_GET()
            finally:
                with lock:
                    seen["now"] -= 1

        def log_message(self, *a, **k):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Slow, directory=str(tmp_path)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        urls = [f"{base}/{i}.png" for i in range(6)] + [f"{base}/missing.png", "pics/local.png", None]
        got = fetch_many(urls)
        assert set(got) == set(urls[:7])  # only the http(s) urls, each once
        assert seen["most"] > 1
        assert all(got[f"{base}/{i}.png"] == png(seed=i) for i in range(6))
        assert isinstance(got[f"{base}/missing.png"], ImageError) and "HTTP 404" in str(got[f"{base}/missing.png"])
        assert from_url(f"{base}/2.png", fetched=got).digest == hashlib.sha256(png(seed=2)).hexdigest()
        with pytest.raises(ImageError, match="HTTP 404"):
            from_url(f"{base}/missing.png", fetched=got)
        assert from_url(f"{base}/5.png", fetched={}).digest == hashlib.sha256(png(seed=5)).hexdigest()
    finally:
        httpd.shutdown()


def test_an_undecodable_images_error_is_the_same_text_on_every_run(tmp_path):
    """PIL names the BytesIO it was given by its memory address; a row's error must not change from run to run."""
    import subprocess
    import sys

    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    (tmp_path / "cut.png").write_bytes(png()[:40])  # a PNG cut short
    said = "from batchjob.images.sources import ImageError, from_url\n" \
           "for name in ('junk.png', 'cut.png', 'data:image/png;base64,AAAA'):\n" \
           "    try:\n        from_url(name, base=__import__('pathlib').Path(r'%s'))\n" \
           "    except ImageError as e:\n        print(e)\n" % tmp_path
    runs = [subprocess.run([sys.executable, "-c", said], capture_output=True, text=True, timeout=600) for _ in range(2)]
    assert runs[0].returncode == 0 and runs[0].stdout.count("does not decode as an image") == 3, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and "0x" not in runs[0].stdout, runs[0].stdout
    assert "junk.png: does not decode as an image (PIL cannot identify it" in runs[0].stdout
    assert "19 bytes starting b'not an i'" in runs[0].stdout
