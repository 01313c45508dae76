"""Evaluation: methods side by side on a task, with paired tests and reports.

Owns resumable runs over a task's problems (``runs``), the summary statistics and paired tests (``summary``)
and the tables, plots and token-level HTML report (``reports``). It imports the decoding core, the policies,
the tasks and the base; never labels, classifier training or an entry point.
"""
