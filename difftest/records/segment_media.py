"""Listenable evidence for a diverged segment: its waveforms as float WAVs and a picture of
where the candidate's spectrum leaves the reference's. Read from the result sidecars that
report.json names; written into a staging folder that MLflow then uploads as is."""

from __future__ import annotations

import logging
import re
import threading
from pathlib import Path

import numpy as np

from ..compare.audio import MEL_HOP, log_mel
from ..family import SAMPLES_PER_FRAME
from ..results import CorruptResult, read_result
from ..suites import wavio
from ..verdicts.where import where

log = logging.getLogger(__name__)

ROLES = ("reference", "candidate", "control", "cross_own")


def safe_name(segment_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", segment_id) or "_"


def _sidecar(path: str, out_dir: Path) -> Path:
    p = Path(path)
    return p if p.is_absolute() else out_dir / p


def load_segment_audio(seg: dict, out_dir: Path) -> dict:
    """role -> Result for the roles whose sidecar can be read; a bad one is skipped with a warning.
    The cross-decode with the named donor's reference codes comes as `cross_donor`."""
    arts = seg.get("artifacts") or {}
    wanted = {r: arts[r] for r in ROLES if arts.get(r)}
    # a length donor lent no codes: decoding with its reference would show nothing of the leak
    if seg.get("donor") and seg.get("donor_kind") != "length" and arts.get(f"cross_donor:{seg['donor']}"):
        wanted["cross_donor"] = arts[f"cross_donor:{seg['donor']}"]
    out = {}
    for role, path in wanted.items():
        try:
            out[role] = read_result(_sidecar(path, out_dir))
        except CorruptResult as e:
            log.warning("segment %s: %s audio not logged: %s", seg["id"], role, e)
    return out


def write_segment_media(seg: dict, out_dir: Path, staging: Path, *, picture: bool = True) -> list[str]:
    """Write audio/<segment>/{role}.wav, difference.wav and specdiff/<segment>.png under staging;
    returns the relative paths written."""
    audio = load_segment_audio(seg, out_dir)
    name = safe_name(seg["id"])
    folder = staging / "audio" / name
    written = []
    for role, r in audio.items():
        folder.mkdir(parents=True, exist_ok=True)
        wavio.write(folder / f"{role}.wav", r.wav, r.sample_rate)
        written.append(f"audio/{name}/{role}.wav")
    ref, cand = audio.get("reference"), audio.get("candidate")
    if ref is None or cand is None:
        return written
    a, b = ref.grid_wav, cand.grid_wav  # from frame 0, as the comparison aligned them
    n = min(len(a), len(b))
    wavio.write(folder / "difference.wav", b[:n] - a[:n], cand.sample_rate)
    written.append(f"audio/{name}/difference.wav")
    if picture:
        png = staging / "specdiff" / f"{name}.png"
        if spectrogram_difference(a, b, cand.sample_rate, png, seg):
            written.append(f"specdiff/{name}.png")
    return written


_PANELS = (("reference", "magma"), ("candidate", "magma"), ("candidate - reference (log-mel)", "RdBu_r"))
_figure = None  # (figure, [(axes, image, colorbar)]): drawn again for each segment
_figure_lock = threading.Lock()  # one picture at a time on the shared figure


def _spectrogram_figure():
    """One figure for every picture of a process: building its axes and colorbars costs more than
    drawing them (about 0.1 s of 0.28 s per picture on two cores)."""
    global _figure
    if _figure is None:
        import matplotlib.pyplot as plt

        # Fixed margins: constrained layout costs about 1 s per figure, more than everything else.
        fig, axes = plt.subplots(3, 1, figsize=(10, 6.5), sharex=True, dpi=72)
        fig.subplots_adjust(left=0.07, right=0.97, top=0.91, bottom=0.08, hspace=0.35)
        panels = []
        for i, (ax, (_, cmap)) in enumerate(zip(axes, _PANELS)):
            im = ax.imshow(np.zeros((1, 1)), origin="lower", aspect="auto", cmap=cmap, interpolation="nearest")
            ax.set_ylabel("mel band")
            bar = fig.colorbar(im, ax=ax, pad=0.01, fraction=0.03)
            # Reference and candidate share one scale, so one bar (the candidate's) says it; the
            # reference's keeps its place (the panels stay aligned) but is not drawn: a sixth of the time.
            panels.append((ax, im, bar if i else None))
            if not i:
                bar.ax.set_visible(False)
        axes[-1].set_xlabel("seconds")
        _figure = (fig, panels)
    return _figure


def spectrogram_difference(ref: np.ndarray, cand: np.ndarray, sample_rate: int, path: Path, seg: dict) -> bool:
    """Reference and candidate log-mel spectrograms and their difference, one above the other,
    with the first divergent frame marked. False (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display; must precede pyplot
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        log.warning("matplotlib is not installed: no spectrogram picture (pip install 'difftest[mlflow]')")
        return False
    a, b = log_mel(ref, sample_rate), log_mel(cand, sample_rate)
    n = min(len(a), len(b))
    diff = b[:n] - a[:n]
    seconds = MEL_HOP / sample_rate
    lim = (float(np.abs(diff).max()) if diff.size else 0.0) or 1.0
    with _figure_lock:
        return _draw(a, b, diff, lim, seconds, sample_rate, path, seg)


def _draw(a, b, diff, lim, seconds, sample_rate, path, seg) -> bool:
    fig, panels = _spectrogram_figure()
    onset = seg.get("first_divergent_frame")
    both = [m for m in (a, b) if len(m)]  # reference and candidate on one scale: their colours compare
    lo, hi = (min(float(m.min()) for m in both), max(float(m.max()) for m in both)) if both else (0.0, 1.0)
    for (ax, im, bar), m, (title, _), v in zip(panels, (a, b, diff), _PANELS, (None, None, lim)):
        for line in list(ax.lines):  # the last segment's onset marker
            line.remove()
        im.set_visible(len(m) > 0)
        if bar is not None:
            bar.ax.set_visible(len(m) > 0)
        # y=1.0 is where matplotlib would put the title anyway (nothing sits above a panel); given,
        # it spares the search for that place at every draw. Same pixels, a tenth less time.
        if len(m) == 0:
            ax.set_title(f"{title}: empty", fontsize=9, y=1.0)
            continue
        im.set_data(m.T)
        im.set_extent((0, len(m) * seconds, 0, m.shape[1]))
        # the colorbar follows on its own (it listens to the image's limits): no update_normal here,
        # which redrew it a second time
        im.set_clim(-v if v else lo, v if v else hi)
        ax.set_title(title, fontsize=9, y=1.0)
        ax.set_xlim(0, max(len(a), len(b), 1) * seconds)
        ax.set_ylim(0, m.shape[1])
        if onset is not None:
            ax.axvline(onset * SAMPLES_PER_FRAME / sample_rate, color="lime", ls="--", lw=1)
    at = where(seg)
    fig.suptitle(f"{seg['id']}: {seg['verdict']}" + (f" ({at})" if at else ""), fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Drawn and saved by hand: RGB (the figure is opaque; savefig keeps an alpha channel, a quarter
    # more to compress) at zlib's fastest level (a noisy picture barely shrinks more).
    from PIL import Image

    fig.canvas.draw()
    Image.frombuffer("RGBA", fig.canvas.get_width_height(), fig.canvas.buffer_rgba(), "raw", "RGBA", 0, 1) \
        .convert("RGB").save(path, "PNG", compress_level=1)
    return True
