"""Sweeps: a grid of ordinary run configs (models x policy sets x task sets, or a list of configs), each run a
Ray task that runs ``kveval run`` in its own resumable run folder, then one cross-run report.

``expand`` (the sweep file's schema and the pure grid expansion), ``load`` (read and validate every run as
``kveval run`` would, before anything starts), ``runner`` (Ray: one child process per run), ``report``
(sweep.json and the cross-run report). The verb is :mod:`kveval.commands.sweep`.
"""
