"""Loss curves as a PNG without matplotlib: a numpy RGB raster, a 5x7 bitmap font, and a
minimal PNG encoder (zlib + struct). Enough for a readable line plot with axes, ticks,
gridlines and a legend by colour."""

from __future__ import annotations

import math
import struct
import zlib

import numpy as np

# 5x7 glyphs: 7 rows of 5 bits (MSB = left column), two hex digits per row.
# fmt: off
_FONT = {
    "0": "0e11131519110e", "1": "040c040404040e", "2": "0e11010204081f", "3": "1f02040201110e",
    "4": "02060a121f0202", "5": "1f101e0101110e", "6": "0608101e11110e", "7": "1f010204080808",
    "8": "0e11110e11110e", "9": "0e11110f01020c", ".": "00000000000c0c", "-": "0000001f000000",
    "+": "0004041f040400", ":": "000c0c000c0c00", "/": "00010204081000", "(": "02040808080402",
    ")": "08040202020408", "_": "0000000000001f", ",": "000000000c0408", "=": "00001f001f0000",
    "%": "18190204081303", " ": "00000000000000", "a": "00000e010f110f", "b": "1010161911111e",
    "c": "00000e1010110e", "d": "01010d1311110f", "e": "00000e111f100e", "f": "0609081c080808",
    "g": "0f1111110f010e", "h": "10101619111111", "i": "04000c0404040e", "j": "0200060202120c",
    "k": "10101214181412", "l": "0c04040404040e", "m": "00001a15151111", "n": "00001619111111",
    "o": "00000e1111110e", "p": "1e1111111e1010", "q": "0f1111110f0101", "r": "00001619101010",
    "s": "00000e100e011e", "t": "08081c08080906", "u": "0000111111130d", "v": "00001111110a04",
    "w": "0000111115150a", "x": "0000110a040a11", "y": "111111110f010e", "z": "00001f0204081f",
}
# fmt: on
_DESCENDERS = set("gpqy")  # drawn 2 rows lower: their 7 rows are rows 2..8 of the cell
_GLYPHS = {
    ch: np.array(
        [[(int(h[2 * r : 2 * r + 2], 16) >> (4 - c)) & 1 for c in range(5)] for r in range(7)],
        dtype=bool,
    )
    for ch, h in _FONT.items()
}
SCALE = 2  # font pixels per glyph pixel
CHAR_W, CHAR_H = 6 * SCALE, 7 * SCALE  # advance (5 columns + 1 space) and height

COLOURS = [
    (31, 119, 180),
    (255, 127, 14),
    (44, 160, 44),
    (214, 39, 40),
    (148, 103, 189),
    (140, 86, 75),
]
WHITE, BLACK, GRID = (255, 255, 255), (0, 0, 0), (225, 225, 225)


def encode_png(rgb: np.ndarray) -> bytes:
    """PNG bytes of an ``[H, W, 3]`` uint8 image (8-bit truecolour, no interlace)."""
    h, w, _ = rgb.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rgb.reshape(h, w * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw.tobytes(), 9))
        + chunk(b"IEND", b"")
    )


def decode_png(data: bytes) -> np.ndarray:
    """Inverse of ``encode_png`` (filter type 0 only): for tests and checks."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in {kind!r}"
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
            assert body[8:] == bytes([8, 2, 0, 0, 0]), "only 8-bit RGB"
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    w, h = size
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    assert not raw[:, 0].any(), "only filter type 0"
    return raw[:, 1:].reshape(h, w, 3)


class Canvas:
    def __init__(self, width: int, height: int):
        self.img = np.full((height, width, 3), WHITE, np.uint8)

    def rect(self, x0, y0, x1, y1, colour):
        h, w, _ = self.img.shape
        x0, x1 = max(0, int(x0)), min(w, int(x1))
        y0, y1 = max(0, int(y0)), min(h, int(y1))
        if x0 < x1 and y0 < y1:
            self.img[y0:y1, x0:x1] = colour

    def line(self, xs, ys, colour, width: int = 2):
        """Polyline through (xs[i], ys[i]) in pixel coordinates."""
        xs, ys = np.asarray(xs, float), np.asarray(ys, float)
        if len(xs) == 1:
            xs, ys = np.repeat(xs, 2), np.repeat(ys, 2)
        # One sample per pixel of length along each segment.
        n = np.maximum(1, np.ceil(np.hypot(np.diff(xs), np.diff(ys)))).astype(int)
        t = np.concatenate([np.arange(k) / k for k in n] + [[1.0]])
        seg = np.concatenate([np.full(k, i) for i, k in enumerate(n)] + [[len(n) - 1]])
        px = xs[seg] + t * (xs[seg + 1] - xs[seg])
        py = ys[seg] + t * (ys[seg + 1] - ys[seg])
        h, w, _ = self.img.shape
        off = np.arange(width) - (width - 1) // 2
        for dx in off:
            for dy in off:
                x = np.rint(px).astype(int) + dx
                y = np.rint(py).astype(int) + dy
                ok = (x >= 0) & (x < w) & (y >= 0) & (y < h)
                self.img[y[ok], x[ok]] = colour

    def text(self, x, y, s: str, colour=BLACK):
        """Draw ``s`` with its top-left corner at (x, y); unknown characters become spaces."""
        for i, ch in enumerate(s.lower()):
            glyph = _GLYPHS.get(ch)
            if glyph is None:
                continue
            big = np.kron(glyph, np.ones((SCALE, SCALE), bool))
            x0, y0 = int(x) + i * CHAR_W, int(y) + (2 * SCALE if ch in _DESCENDERS else 0)
            region = self.img[y0 : y0 + big.shape[0], x0 : x0 + big.shape[1]]
            region[big[: region.shape[0], : region.shape[1]]] = colour


def nice_ticks(lo: float, hi: float, target: int = 6) -> list[float]:
    """Round tick values (1, 2 or 5 times a power of ten) covering [lo, hi]."""
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / target
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 5, 10)), key=lambda st: abs((hi - lo) / st - target))
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _label(v: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    return f"{v:.{decimals}f}"


def line_plot(
    series: list[dict], *, title: str, xlabel: str, ylabel: str, width: int = 900, height: int = 560
) -> np.ndarray:
    """RGB image of ``series``: dicts with ``label``, ``x``, ``y``, ``colour`` and optional
    ``width`` (line px) and ``marker`` (square size px, drawn at each point)."""
    cv = Canvas(width, height)
    left, right, top, bottom = 84, 24, 40, 70
    x0, x1, y0, y1 = left, width - right, top, height - bottom
    xs = np.concatenate([np.asarray(s["x"], float) for s in series if len(s["x"])])
    ys = np.concatenate([np.asarray(s["y"], float) for s in series if len(s["y"])])
    finite = np.isfinite(ys)
    ylo, yhi = (ys[finite].min(), ys[finite].max()) if finite.any() else (0.0, 1.0)
    pad = 0.04 * (yhi - ylo or 1.0)
    xticks, yticks = nice_ticks(xs.min(), xs.max()), nice_ticks(ylo - pad, yhi + pad)
    xlo, xhi = min(xs.min(), xticks[0]), max(xs.max(), xticks[-1])
    ylo, yhi = min(ylo - pad, yticks[0]), max(yhi + pad, yticks[-1])
    px = lambda v: x0 + (np.asarray(v, float) - xlo) / ((xhi - xlo) or 1) * (x1 - x0)
    py = lambda v: y1 - (np.asarray(v, float) - ylo) / ((yhi - ylo) or 1) * (y1 - y0)

    xstep = xticks[1] - xticks[0] if len(xticks) > 1 else 1.0
    ystep = yticks[1] - yticks[0] if len(yticks) > 1 else 1.0
    for v in xticks:
        cv.rect(px(v), y0, px(v) + 1, y1, GRID)
        lab = _label(v, xstep)
        cv.rect(px(v), y1, px(v) + 1, y1 + 6, BLACK)
        cv.text(px(v) - len(lab) * CHAR_W / 2, y1 + 10, lab)
    for v in yticks:
        cv.rect(x0, py(v), x1, py(v) + 1, GRID)
        lab = _label(v, ystep)
        cv.rect(x0 - 6, py(v), x0, py(v) + 1, BLACK)
        cv.text(x0 - 10 - len(lab) * CHAR_W, py(v) - CHAR_H / 2, lab)
    for a, b, c, d in (
        (x0, y0, x1, y0 + 1),
        (x0, y1, x1 + 1, y1 + 1),
        (x0, y0, x0 + 1, y1),
        (x1, y0, x1 + 1, y1),
    ):
        cv.rect(a, b, c, d, BLACK)

    for s in series:
        ok = np.isfinite(np.asarray(s["y"], float))
        if not ok.any():
            continue
        sx, sy = px(np.asarray(s["x"])[ok]), py(np.asarray(s["y"])[ok])
        cv.line(sx, sy, s["colour"], s.get("width", 2))
        m = s.get("marker", 0)
        for x, y in zip(sx, sy, strict=True):
            cv.rect(x - m // 2, y - m // 2, x + m // 2 + 1, y + m // 2 + 1, s["colour"])

    cv.text((width - len(title) * CHAR_W) / 2, 12, title)
    cv.text((x0 + x1 - len(xlabel) * CHAR_W) / 2, height - CHAR_H - 14, xlabel)
    cv.text(8, 12, ylabel)
    # Legend, top right inside the axes: a colour swatch and the label per series.
    lw = max(len(s["label"]) for s in series) * CHAR_W + 44
    lx, ly = x1 - lw - 10, y0 + 10
    cv.rect(lx - 6, ly - 6, lx + lw, ly + len(series) * (CHAR_H + 8) + 2, WHITE)
    for i, s in enumerate(series):
        yy = ly + i * (CHAR_H + 8)
        cv.rect(lx, yy + CHAR_H // 2 - 2, lx + 28, yy + CHAR_H // 2 + 2, s["colour"])
        cv.text(lx + 36, yy, s["label"])
    return cv.img


def loss_plot_png(runs: dict[str, dict]) -> bytes:
    """PNG of loss curves: per run (name -> {"train": (steps, losses), "val": (steps,
    losses)}) a thin light train line and a thick val line with markers, one colour per run."""
    series = []
    for i, (name, r) in enumerate(runs.items()):
        colour = COLOURS[i % len(COLOURS)]
        light = tuple(int(c + (255 - c) * 0.45) for c in colour)
        series.append(
            {
                "label": f"{name} train",
                "x": r["train"][0],
                "y": r["train"][1],
                "colour": light,
                "width": 1,
            }
        )
        if len(r["val"][0]):
            series.append(
                {
                    "label": f"{name} val",
                    "x": r["val"][0],
                    "y": r["val"][1],
                    "colour": colour,
                    "width": 3,
                    "marker": 7,
                }
            )
    img = line_plot(series, title="loss vs step", xlabel="optimizer step", ylabel="loss (nats)")
    return encode_png(img)
