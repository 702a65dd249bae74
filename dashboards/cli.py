"""`difftest dashboard --out SITE`: a static site for the maintainers, built from the MLflow store.

Every logged run (versions over time, pass or fail, divergence rates, onset quality), a page per
run (segments × chunks heatmap), a page per diverged segment (audio, spectrogram difference, the
codes at the first divergent frame, the donor, links into the MLflow UI), and the bisects. It needs
no server: open SITE/index.html. Run it again on the same SITE to refresh; runs already fetched
are not downloaded again. docs/dashboard.md.
"""

from __future__ import annotations

import argparse
import sys

from difftest.errors import EXIT_INFRA, EXIT_PASS

DEFAULT_UI = "http://127.0.0.1:5000"
# media.py's AUDIO_FORMATS and DEFAULT_AUDIO, written out: the parser is built at every CLI start, without numpy
AUDIO_CHOICES = ("opus", "flac", "wav")
DEFAULT_AUDIO = "opus"


def main_dashboard(args) -> int:
    from difftest.records.tracking import TrackingUnavailable, resolve_tracking_uri

    try:
        from dashboards.site import build
    except ImportError as e:  # jinja2 comes with the mlflow extra, as mlflow does
        print(f"difftest: error: the dashboard needs {e.name}: pip install 'difftest[mlflow]'", file=sys.stderr)
        return EXIT_INFRA

    if args.audio != "wav":
        try:
            import soundfile  # noqa: F401  (libsndfile encodes the FLAC and Opus copies)
        except (ImportError, OSError) as e:
            print(f"difftest: error: --audio {args.audio} needs soundfile ({e}): pip install 'difftest[mlflow]', "
                  f"or --audio wav", file=sys.stderr)
            return EXIT_INFRA
    uri = resolve_tracking_uri(args.tracking_uri)
    try:
        built = build(uri, args.out, ui_url=args.mlflow_ui_url, experiments=args.experiment or None, title=args.title,
                      audio=args.audio)
    except TrackingUnavailable as e:
        print(f"difftest: error: could not read MLflow at {uri}: {e}", file=sys.stderr)
        return EXIT_INFRA
    for note in built.notes:
        print(f"difftest dashboard: note: {note}", file=sys.stderr)
    print(f"dashboard: {built.index} ({built.runs} runs, {built.segment_pages} diverged segment pages, "
          f"{built.bisects} bisects; open it in a browser, no server needed)")
    return EXIT_PASS


def add_dashboard_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("dashboard", help="build a static HTML dashboard of the runs and bisects in MLflow",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, metavar="SITE",
                   help="the site's folder: new, empty, or an earlier dashboard (refreshed in place)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else "
                                          "sqlite:///<cwd>/mlflow.db with artifacts in ./mlruns)")
    p.add_argument("--mlflow-ui-url", default=DEFAULT_UI,
                   help=f"where the MLflow UI is served, for links to runs (default {DEFAULT_UI})")
    p.add_argument("--experiment", action="append", default=[], metavar="NAME",
                   help="only this experiment, e.g. difftest/smoke or difftest/bisect/smoke (repeatable; "
                        "default: all)")
    p.add_argument("--title", default="difftest dashboard", help="the name in the page header")
    p.add_argument("--audio", choices=AUDIO_CHOICES, default=DEFAULT_AUDIO,
                   help="how the site stores the segments' audio: opus (default; lossy listening copies, the "
                        "smallest site; each player links its float32 original in MLflow), flac (lossless "
                        "copies, to 24 bits, 16-bit audio exactly; about 5.5x the size), wav (MLflow's float32 "
                        "WAVs as they are, the largest)")
    p.set_defaults(func=main_dashboard)
    return p
