"""The documentation site as a reader sees it.

The site is built with ``mkdocs build --strict`` (a broken link, a missing snippet or an API
reference that does not resolve fails the build, and so this module), served from 127.0.0.1, and
two pages are rendered in headless Chromium: the home page and the API reference of
``amp_fx.compile``. After rendering (Material's JavaScript included), the DOM must hold the
navigation with every page named in mkdocs.yml's ``nav`` and highlighted code blocks, and each
page is screenshotted: into ``$AMP_FX_SCREENSHOTS`` when it is set (to look at), else into the
test's tmp dir. Needs the ``docs`` extra (``pip install -e ".[docs]"``, the primary environment
only) and Debian's ``chromium`` package (``.ci/run`` installs it); skips with the reason without
them.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import struct
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]
_WINDOW = (1280, 900)
# Flags that run Chromium here: as root (no sandbox), without a GPU, and without reaching any
# network beyond the local server (no QUIC, background updates, sync or component downloads).
_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    f"--window-size={_WINDOW[0]},{_WINDOW[1]}",
    # lets the page's scripts run (Material builds the copy buttons and the search) before
    # the DOM is dumped or the screenshot taken
    "--virtual-time-budget=5000",
)


def _nav_titles(nav: list) -> list[str]:
    """The titles mkdocs.yml's ``nav`` gives, sections included (untitled entries take the page's
    own heading, which is not named there)."""
    titles = []
    for entry in nav:
        if isinstance(entry, dict):
            for title, value in entry.items():
                titles.append(title)
                if isinstance(value, list):
                    titles += _nav_titles(value)
    return titles


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, f"mkdocs build --strict failed:\n{built.stderr}"
    return out


@pytest.fixture(scope="module")
def nav() -> list:
    import yaml  # a dependency of mkdocs

    return yaml.safe_load((_ROOT / "mkdocs.yml").read_text())["nav"]


def _pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            pages += _pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_nav_page_is_built(site: Path, nav: list) -> None:
    pages = _pages(nav)
    assert "index.md" in pages and "api.md" in pages
    missing = [p for p in pages if not (site / p.replace(".md", ".html")).is_file()]
    assert missing == []


@pytest.fixture(scope="module")
def server(site: Path) -> Iterator[str]:
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        thread.join()


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    profile.mkdir()
    return subprocess.run(
        [chromium, *_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=180
    )


def _png_first_row(png: bytes) -> tuple[int, int, list[tuple[int, ...]], int]:
    """Width, height, the top row's pixels and the number of distinct byte values in the
    (filtered) image data of an 8-bit RGB or RGBA PNG, as Chromium writes them."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, data, header = 8, b"", b""
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos : pos + 8])
        body = png[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        data += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), (depth, color)
    channels = 3 if color == 2 else 4
    raw = zlib.decompress(data)
    kind, row = raw[0], bytearray(raw[1 : 1 + width * channels])
    # the first row's filters: None, Sub, Up (of a zero row), Average and Paeth reduce to these
    for i in range(channels, len(row)):
        if kind in (1, 4):
            row[i] = (row[i] + row[i - channels]) & 0xFF
        elif kind == 3:
            row[i] = (row[i] + row[i - channels] // 2) & 0xFF
    pixels = [tuple(row[i : i + channels][:3]) for i in range(0, len(row), channels)]
    return width, height, pixels, len(set(raw))


_PAGES = {
    # name: (the page whose DOM is checked, the page screenshotted)
    "home": ("index.html", "index.html"),
    # amp_fx.compile is the reference's first entry, so the page's top shows it; a screenshot
    # scrolled to the anchor shows the header half-way down in headless Chromium.
    "api-compile": ("api.html#amp_fx.compile", "api.html"),
}
# A Pygments-highlighted code block as Material renders it: a token span inside <code> inside a
# `highlight` block.
_HIGHLIGHTED = re.compile(r'class="[^"]*\bhighlight"><pre[^>]*>.*?<code>.*?<span class="(?:n|nf|nn|kn|k)">', re.S)


@pytest.mark.parametrize("name", list(_PAGES))
def test_page_renders_navigation_and_highlighted_code(name: str, server: str, nav: list, tmp_path: Path) -> None:
    path, shot_path = _PAGES[name]
    dumped = _chromium(tmp_path, "--dump-dom", f"{server}/{path}")
    assert dumped.returncode == 0, dumped.stderr
    dom = dumped.stdout
    # Material's scripts ran: they mark <html> and add a copy button to every code block
    assert 'class="js-focus-visible js"' in dom
    assert 'class="md-code__button"' in dom
    # the navigation, with every page and section mkdocs.yml names
    assert 'class="md-nav md-nav--primary"' in dom
    missing = [t for t in _nav_titles(nav) if not re.search(r">\s*" + re.escape(t) + r"\s*<", dom)]
    assert missing == [], f"nav titles not rendered: {missing}"
    if name == "api-compile":
        # mkdocstrings rendered the docstring: the heading, the signature and the arguments
        start = dom.index('<h2 id="amp_fx.compile"')
        section = dom[start : dom.index('id="amp_fx.AmpCompiledModule"')]
        assert re.search(r">\s*amp_fx\.compile\s*<", section), "heading"
        assert _HIGHLIGHTED.search(section), "no highlighted signature"
        for argument in ("model_or_fn", "dtype", "policy", "backend", "weight_cache"):
            assert f"<code>{argument}</code>" in section, argument
    else:
        assert re.search(r"<h1[^>]*>\s*amp_fx\s*<", dom), "heading"
        block = _HIGHLIGHTED.search(dom)
        assert block and '<span class="kn">import</span>' in dom[block.start() :], "no highlighted code block"

    shots = Path(os.environ.get("AMP_FX_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    shot = shots / f"{name}.png"
    taken = _chromium(tmp_path, f"--screenshot={shot}", f"{server}/{shot_path}")
    assert taken.returncode == 0, taken.stderr
    width, height, top, distinct = _png_first_row(shot.read_bytes())
    assert (width, height) == _WINDOW
    # The top of the window is Material's header bar in the theme's primary colour (indigo in
    # mkdocs.yml), not a blank page or an unstyled one: blue well above red and green.
    r, g, b = top[width // 2]
    assert b > 120 and b > r + 60 and b > g + 60, f"{shot}: top row is {top[width // 2]}, not the header"
    # A blank page filters to a handful of byte values; text and highlighted code give hundreds.
    assert distinct > 64, f"{shot} looks blank"
