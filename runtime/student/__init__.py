"""Student Parallelism: a tenant's teacher (PLOT inputs -> upper layers with its PET ->
head) distilled into a group of shallow students whose boosted sum replaces the deep stack.

    model.py   a student and a group (weights stacked along a student axis), the reference math
    stack.py   virtual stacking: every student of a batch (and of many tenants) in one computation
    train.py   boosting on the teacher's final representation + stacking distillation
    prune.py   adaptive student pruning (SP Alg. 2): one head for the sums of the first k students
    policy.py  online pruning: how many students (or the teacher) a batch gets under the load
    buffer.py  SP's length-aware buffer: batches of requests of similar length
    engine.py  a serving loop over the store that puts the pieces together (the benchmark's)
    build.py   construction over a store path (train, prune, store as the tenant's students record)
    record.py  a stored students record as a servable group: complete and fresh (not stale)
    executor.py  students in the runtime's batches (wraps the runtime's executor)
    serve.py   students in runtime.Runtime: which requests may get students, the per-batch decision
"""
