"""SLO-driven sizing of the prefill and decode pools (`pdserve plan`).

- `profile`: an engine's measured costs on its hardware (step-time and KV-transfer models, the
  engine's shape), as JSON;
- `workload`: the traffic to size for (rate, burstiness, lengths, prefix sharing, or a trace);
- `simulator`: a discrete-event simulation of a deployment, each engine the engine's real
  `Scheduler` with step times from the profile;
- `search`: analytic lower bounds, then the cheapest deployment the simulation says meets the SLOs.

It imports the engine's scheduler (torch-free) and nothing above it; the operator may import it.
"""
