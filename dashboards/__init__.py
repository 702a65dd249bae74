"""`difftest dashboard`: a static site, built from the MLflow store, for the maintainers.

A consumer of what difftest records: it reads the MLflow store and run folders, and nothing in
`difftest/` imports it but the CLI, which registers the subcommand.

    gather.py   what to show, read from MLflow (runs, their report.json and media, bisects)
    media.py    the site's copies of the media: audio as Opus (or FLAC), spectrograms as palette PNGs
    model.py    per-chunk cells, rates, onset quality, each run's change against the one before
    pages.py    what each page shows; templates/*.html write it (Jinja2, autoescaped; html.py
                formats numbers and links; assets.py is the stylesheet)
    site.py     build(): gather, then write SITE/ (openable from file://, no server, no CDN)
    cli.py      the subcommand (add_dashboard_parser)
    browser.py  headless Chromium over the DevTools protocol (the tests look at the site with it)

docs/dashboard.md says what is where.
"""
