"""The system tier: the whole system under faults, load and hostile input: workers killed or
stalled mid-call, resource leaks and soak over many cycles, request bounds under stress, hostile
bodies and scans, Ray clusters of one and two nodes. Slow by nature; every test still stops by
itself (bounded counts and time) and sends traffic only to loopback.

Workers come from the root conftest; fixtures only this tier needs live here.
"""
