"""Cluster-scale discrete-event simulator and BCR planner for PDD (issue 7).

It reuses the real system's decisions unchanged: pdd_serve.policy (pipeline, MD replica, handoff),
pdd_serve.transport.link.LinkModel (KV transfer times) and pdd_serve.engine.radix_cache.RadixCache
(P's prefix cache and MD's DRC). Assumptions live in the one chip and model catalog
(pdd_serve/emulation/costmodel.yaml) and scenarios/*.yaml.
Nothing heavy is imported here: `pdd --help` imports evaluations.sim.cli.
"""
