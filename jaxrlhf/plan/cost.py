"""Dollars: what a real run costs over its roofline, and the seed analysis's build-vs-API bands."""

from __future__ import annotations

import math


# What a real run costs over the roofline estimate: runs reaching 60% / 40% of the roofline.
SLOWDOWN = (1.7, 2.5)


# The seed analysis's build-vs-API bands, US dollars of alignment training per month.
BANDS = ((50_000, "under $50k/month: use API fine-tuning services (Together AI, Fireworks, "
                  "Anyscale)"),
         (200_000, "$50k-200k/month: reserved H100 clusters running DPO"),
         (math.inf, "above $200k/month: a dedicated alignment cluster with PPO capability"))


def band(usd_per_month: float) -> str:
  """Where a monthly alignment spend falls in the seed's build-vs-API bands."""
  for limit, text in BANDS:
    if usd_per_month < limit:
      return text
  return BANDS[-1][1]
