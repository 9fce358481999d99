"""Experiments on the real loop: the machinery of ``tools/experiment.py`` (time to reward over
seeds) and ``tools/sweep.py`` (a grid of short runs), which are its entry points.

    grid     the config files and the cells they name
    runs     one ``april up`` run: its command, its window, the initial policy, --resume, held-out evaluation
    numbers  what a run left, as numbers; reward levels and times to them; a cell over its seeds
    sim      the cells in the cluster simulator
    report   the tables, the docs block, a sweep's results files
    plot     the figures (matplotlib, imported when drawing)
    cli      the two commands
"""
