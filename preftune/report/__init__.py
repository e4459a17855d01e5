"""`preftune report RUN_DIR`: PNG charts of a run's metrics and one self-contained HTML page."""
