"""Multi-level inference after Tabi (Wang et al., EuroSys '23): answer from the PLOT level
when it is sure, re-route the rest to the exact level.

* Level 1: the tenant's hPLM (PLOT inputs + PET), what ``runtime.infer`` always served.
* Level 2: the same tenant with its lower layers computed in full context (the encoder the
  tenant's PLOT version stands for, ``runtime.model.stored.context_encoder``), PET unchanged.

Rooms of the idea: ``runtime.model.calibrate`` (Eq. 3, a temperature per tenant and level;
ECE: model math, so that construction fits a tenant's temperatures when it is created),
``dispatch`` (Eq. 4 and the coverage gate), ``prune`` (Eq. 5, words by level-1 attention),
``ensemble`` (Eq. 6), ``profile`` (§5: choose c, k, alpha, w and the coverage gate on
held-out data from saved level outputs; the tenant's ``levels`` record) and ``serve`` (the
policies ``fast`` | ``auto`` | ``exact`` behind ``runtime.Runtime.infer``). Level 2's inputs are
an input source of the executor's batch plans (runtime.exec.context); the engine
(runtime.engine) routes each request to its level and re-routes what the dispatcher sends up.
"""
