"""Admission: what may come in, and how fast. ``ratelimit`` (``TokenBucket``, ``Limiter`` and
``RateLimits``: token buckets per key and tier), ``anomaly`` (``AnomalyPolicy`` and
``AnomalyControl``: a sliding-window AIMD control of the admitted rate) and ``tiers`` (QoS tier
names and levels, and a request's tier from a header or gRPC metadata). The transports' own
admission of requests (room in a batcher or an inbox, deadlines) is ``aisp.serve.admission``."""
