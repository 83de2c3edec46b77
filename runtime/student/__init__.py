"""Student Parallelism: a tenant's teacher (PLOT inputs -> upper layers with its PET ->
head) distilled into a group of shallow students whose boosted sum replaces the deep stack.

    train.py   boosting on the teacher's final representation + stacking distillation
    prune.py   adaptive student pruning (SP Alg. 2): one head for the sums of the first k students
    policy.py  online pruning: how many students (or the teacher) a batch gets under the load
    buffer.py  SP's length-aware buffer: batches of requests of similar length
    build.py   construction over a store path (train, prune, store as the tenant's students record)
    record.py  a stored students record as a servable group: complete and fresh (not stale)
    serve.py   students in runtime.Runtime: which requests may get students, the per-batch decision

The math lives below this room: runtime/model/student.py (a student and a group, weights stacked
along a student axis, the reference math) and runtime/exec/students.py, students_gpu.py
(virtual stacking: every student of a batch, of many tenants, in one computation; the rows
of a batch plan whose input source is ``students``).
"""
