"""The paper's tables rebuilt from run records (Markdown and LaTeX), with the paper's values beside.

    python -m rbs_bench.tables [--results results] [--out results/tables]

For every results/runs/<experiment>/<model> directory it writes <out>/<experiment>_<model>.md and
.tex, built from the records on disk only (never by rerunning a model). An experiment with a table
spec (SPECS) gets the paper's layout; any other gets a summary table (report.summarize);
calibration_cost reads its calibration records (LOADERS). Where the run's setting is the paper's
(model, context length) a cell shows "ours (paper)", with the paper's numbers read from
results/paper/paper_values.csv. Every table lists the records files it used. The timing
experiments' tables (speed, memory, throughput, selector_time) come from timing.py, which this
command also runs.

    experiment         paper table                               layout
    ruler_budget       Table 2 (tab:ruler_budget)                targets x methods, density / acc.
    longbench_v2       Table 3 (tab:longbench_dual)              methods x length classes, density
    ruler_main         Table 4 (tab:ruler)                       methods (+ density row) x lengths
    infinitebench      Table 5 (tab:InfiniteBench)               tasks x methods, macro average
    videomme           Table 6 (tab:videomme)                    methods x durations
    selector_ablation  Tables 7, 12 (tab:selector_ablation,      selectors: density, accuracy,
                       tab:selector_breakdown)                   bootstrap 95% CI; task groups
    strict_density     Table 8 (tab:strict_density)              methods x anchors
    block_size         Table 9 (tab:block_sensitivity)           selector x block size
    thresholds         Table 10 (tab:threshold_sensitivity)      threshold pairs
    calibration_cost   Table 11 (tab:calibration)                methods: cost and max error

The paper values file, results/paper/paper_values.csv, is the one copy of the paper's numbers:
each value as printed, with the line of the paper's source that prints it.

The package, each module importing only those above it:

    paper.py    the paper's values (paper_values.csv, PaperValues)
    render.py   Cell and Table, Markdown and LaTeX, method and context labels
    layout.py   cell means and intervals, the generic layouts GridSpec / RowSpec / SummarySpec
    specs.py    each experiment's table spec (SPECS, LOADERS)
    timing.py   the timing experiments' tables and speedup figure, from results/speed CSVs
    claims.py   the paper's claims decided by the records (claims_<model>.md): each paired
                difference with its interval and Holm-corrected p, and a verdict
    build.py    every table of a results directory; the command line (__main__.py)
"""
