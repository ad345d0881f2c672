"""Odd image files for the serving and training-input tests: every supported format and shape,
and corrupt, truncated, empty and oversized ones (built cheaply, never decoded at full size)."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image

OVERSIZED_SIDE = 20_000  # 400 megapixels: a 20000x20000 grayscale PNG compresses to ~400 KB.


def photo(height: int = 60, width: int = 80) -> np.ndarray:
    """A uint8 RGB crop of one of scikit-learn's sample photos."""
    from sklearn.datasets import load_sample_images

    return load_sample_images().images[0][100:100 + height, 200:200 + width]


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def _png_chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def blank_gray_png(side: int = OVERSIZED_SIDE) -> bytes:
    """A valid side x side 8-bit grayscale PNG of zeros, written with zlib row by row (no big array)."""
    compressor = zlib.compressobj(9)
    row = bytes(side + 1)  # Filter byte 0, then `side` black pixels.
    idat = b"".join(compressor.compress(row) for _ in range(side)) + compressor.flush()
    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", idat)
            + _png_chunk(b"IEND", b""))


def jpeg_claiming(height: int, width: int) -> bytes:
    """A small valid JPEG whose frame header (SOF0) is rewritten to claim height x width."""
    data = bytearray(encode(Image.fromarray(photo(16, 16)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def gif_claiming(height: int, width: int) -> bytes:
    data = bytearray(encode(Image.fromarray(photo(16, 16)), "GIF"))
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


def bmp_claiming(height: int, width: int) -> bytes:
    data = bytearray(encode(Image.fromarray(photo(16, 16)), "BMP"))
    data[18:26] = struct.pack("<ii", width, height)
    return bytes(data)


def valid_images() -> dict[str, bytes]:
    """Every supported format and pixel layout, 1x1 images and extreme aspect ratios."""
    rgb = photo()
    alpha = np.linspace(0, 255, rgb.shape[0] * rgb.shape[1]).reshape(rgb.shape[:2]).astype(np.uint8)
    rgba = Image.fromarray(np.dstack([rgb, alpha]))
    gray = Image.fromarray(rgb).convert("L")
    frames = [Image.fromarray(rgb), Image.fromarray(255 - rgb)]
    return {
        "jpeg": encode(Image.fromarray(rgb), "JPEG", quality=95),
        "jpeg_gray": encode(gray, "JPEG", quality=95),
        "jpeg_cmyk": encode(Image.fromarray(rgb).convert("CMYK"), "JPEG", quality=95),
        "jpeg_progressive": encode(Image.fromarray(rgb), "JPEG", progressive=True),
        "png": encode(Image.fromarray(rgb), "PNG"),
        "png_rgba": encode(rgba, "PNG"),
        "png_gray": encode(gray, "PNG"),
        "png_gray_alpha": encode(Image.merge("LA", [gray, Image.fromarray(alpha)]), "PNG"),
        "png_16bit": encode(Image.fromarray((np.asarray(gray, np.uint16) * 257)), "PNG"),
        "png_palette": encode(Image.fromarray(rgb).convert("P"), "PNG"),
        "gif": encode(Image.fromarray(rgb), "GIF"),
        "gif_animated": encode(frames[0], "GIF", save_all=True, append_images=frames[1:]),
        "bmp": encode(Image.fromarray(rgb), "BMP"),
        "png_1x1": encode(Image.fromarray(rgb[:1, :1]), "PNG"),
        "jpeg_1x1": encode(Image.fromarray(rgb[:1, :1]), "JPEG"),
        "png_1x4000": encode(Image.fromarray(np.tile(rgb[:1], (1, 50, 1))), "PNG"),
        "jpeg_4000x2": encode(Image.fromarray(np.tile(rgb[:2, :2], (2000, 1, 1))), "JPEG"),
    }


def bad_images() -> dict[str, tuple[str, bytes, str]]:
    """name -> (kind, bytes, regex the INVALID_ARGUMENT message must match)."""
    valid = valid_images()
    over = r"over the limit of max_pixels=\d+ pixels"
    unsupported = r"Unsupported or corrupt image \(\d+ bytes\)"
    png_body = bytearray(valid["png"])
    png_body[60:160] = bytes(100)  # Inside IDAT: the chunk's CRC no longer matches.
    return {
        "empty": ("empty", b"", r"Empty image: 0 bytes"),
        "text": ("corrupt", b"definitely not an image", unsupported),
        "random_bytes": ("corrupt", np.random.default_rng(0).bytes(3000), unsupported),
        "jpeg_signature_then_junk": ("corrupt", b"\xff\xd8\xff" + bytes(64), r"Invalid JPEG data"),
        "png_bad_idat": ("corrupt", bytes(png_body), r"Invalid PNG data"),
        "truncated_jpeg": ("truncated", valid["jpeg"][:len(valid["jpeg"]) // 2], r"Invalid JPEG data"),
        "truncated_png": ("truncated", valid["png"][:len(valid["png"]) // 2], r"Invalid PNG data"),
        "truncated_gif": ("truncated", valid["gif"][:len(valid["gif"]) // 2], r"Invalid GIF data"),
        "truncated_bmp": ("truncated", valid["bmp"][:len(valid["bmp"]) // 2], r"Input size should match"),
        "oversized_png_20000x20000": ("oversized", blank_gray_png(), over),
        "oversized_jpeg_30000x30000": ("oversized", jpeg_claiming(30_000, 30_000), over),
        "oversized_gif_65535x65535": ("oversized", gif_claiming(65_535, 65_535), over),
        "oversized_bmp_50000x50000": ("oversized", bmp_claiming(50_000, 50_000), over),
        "oversized_bmp_negative_height": ("oversized", bmp_claiming(-50_000, 50_000), over),
    }
