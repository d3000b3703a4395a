"""Reports over run directories: figures, tables with intervals and paired tests, JSON.

    python -m fedfm_flower.report runs/glyphs --out reports/glyphs --reference local

Modules: ``runs`` (reading finished run directories), ``tables`` (statistics, Markdown and
LaTeX), ``variance`` (which variance a setup's intervals carry: one data draw or a draw per
seed), ``transfer`` (whether a base setup's verdicts hold on its ``base~name`` transfer setups),
``figures`` (PNG plots), ``task_table`` (FedDPA's per-task ROUGE-1 table), ``pair_table``
(TAP's per-pair table with Welch's t-test), ``domain_table`` (pFedPG's per-domain values),
``replacements`` (TAP's replacement counts per round), ``build`` (the whole report, and the
command line).
"""
