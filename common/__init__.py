"""What every service uses, and nothing of any service: TLS and API keys, logging, metric histograms, the
byte-level alphabet, the limits both halves agree on, usage counts, small helpers. No torch."""
