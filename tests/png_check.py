"""What a PNG the code drew shows: its coloured pixels (the data a plot draws: lines, bars,
points, filled contours in colour) as opposed to an empty plot's white background and its grey
and black axes, ticks and labels."""
from __future__ import annotations

from pathlib import Path


def coloured_pixels(path: Path, *, min_chroma: float = 0.25) -> int:
    """Opaque pixels whose colour is far from grey (max - min of R, G, B above `min_chroma`)."""
    import matplotlib.image

    image = matplotlib.image.imread(str(path))  # floats in [0, 1], RGB or RGBA
    rgb = image[..., :3]
    opaque = image[..., 3] > 0.5 if image.shape[-1] == 4 else True
    chroma = rgb.max(axis=-1) - rgb.min(axis=-1)
    return int(((chroma > min_chroma) & opaque).sum())
