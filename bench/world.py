"""A hidden ad world for `adstream simulate`: who asks, which ads could be shown, the true CTR of each
pair, and when a click comes. Pure given its seed (numpy only); the served model never sees it.

    context (user, site, device, hour) x candidate ads --true_ctr--> the chance of a click
    logit = base + user + site + device + hour(ad category) + ad + campaign
            + <user taste, ad category factor>            (a cross only a model of pairs learns)
    drift: every ad's quality walks (std drift_per_min per minute of the run)
    a new campaign launches at new_campaign_at_s: new ad ids, better than most
    click delay: log-normal (median click_delay_median_s, heavy tail), cut at max_delay_s

Events are Criteo-shaped (the criteo schema: I1..I13 integers, C1..C26 hex32 categories):
C1 user, C2 site, C3 device, C4 ad, C5 campaign, C6 advertiser, C7 ad category, C8 user segment,
C9..C12 noise (no effect: the model must learn to ignore them), I1 hour, I2 the user's activity
(a log-normal count; its effect is folded into the user's bias), the rest missing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NOISE_FIELDS = ("C9", "C10", "C11", "C12")


@dataclass(frozen=True)
class WorldConfig:
    seed: int = 11  # same seed, same world and the same requests
    users: int = 20_000  # Zipf-popular: most requests come from a few thousand of them
    sites: int = 400
    ads: int = 300  # ads running at the start
    campaigns: int = 60  # each ad belongs to one; advertisers hold 4 campaigns each
    categories: int = 24  # ad categories; users have tastes over them
    taste_dim: int = 4  # width of the user-taste x ad-category cross
    base_ctr: float = 0.04  # the typical shown ad's click rate is near this
    drift_per_min: float = 0.08  # std of each ad's quality walk per minute
    new_campaign_at_s: float = 120.0  # seconds into the run a new campaign launches
    new_campaign_ads: int = 12  # its ads (new ids, never seen before)
    new_campaign_lift: float = 0.9  # its quality above the average ad's, in logits
    click_delay_median_s: float = 3.0  # log-normal delay of a click after its impression
    click_delay_sigma: float = 1.3  # its spread (heavy tail: 10% of clicks come after ~16 s)
    max_delay_s: float = 60.0  # delays are cut here (under the simulation's attribution window)


class World:
    """The truth of one simulated world; `advance(t)` moves its drift to t seconds into the run."""

    def __init__(self, config: WorldConfig = WorldConfig()) -> None:
        self.config = c = config
        rng = np.random.default_rng(c.seed)
        self._rng = np.random.default_rng(c.seed + 1)
        ranks = np.arange(1, c.users + 1, dtype=np.float64) ** -1.05
        self._user_p = ranks / ranks.sum()
        self.user_bias = rng.normal(0, 0.5, c.users)
        self.user_taste = rng.normal(0, 0.6, (c.users, c.taste_dim))
        self.user_activity = rng.lognormal(2.0, 1.0, c.users).astype(np.int64)
        self.site_bias = rng.normal(0, 0.4, c.sites)
        self.device_bias = np.array([0.0, -0.3, 0.2, -0.6])
        self.hour_category = rng.normal(0, 0.2, (24, c.categories))
        self.category_factor = rng.normal(0, 0.6, (c.categories, c.taste_dim))
        total = c.ads + c.new_campaign_ads
        self.ad_campaign = np.concatenate(
            [rng.integers(0, c.campaigns, c.ads), np.full(c.new_campaign_ads, c.campaigns)]
        )
        self.ad_category = rng.integers(0, c.categories, total)
        self.campaign_quality = np.concatenate([rng.normal(0, 0.5, c.campaigns), [c.new_campaign_lift]])
        self.ad_quality = rng.normal(0, 0.4, total)
        self.ad_quality[c.ads :] = 0.0  # the new campaign's ads: its campaign's quality alone
        self.bias = float(np.log(c.base_ctr / (1 - c.base_ctr))) - 0.6  # the shown ads are the better ones
        self.hex = {  # each (field, index) an 8-hex-digit category value
            name: rng.integers(0, 1 << 32, size, dtype=np.int64)
            for name, size in (
                ("C1", c.users),
                ("C2", c.sites),
                ("C3", 4),
                ("C4", total),
                ("C5", c.campaigns + 1),
                ("C6", c.campaigns // 4 + 2),
                ("C7", c.categories),
                ("C8", 64),
                *((f, 1000) for f in NOISE_FIELDS),
            )
        }
        self.t_s = 0.0

    def advance(self, t_s: float) -> None:
        """Drift to t_s seconds into the run (ad qualities walk; it never goes back)."""
        dt = max(0.0, t_s - self.t_s) / 60.0
        if dt:
            self.ad_quality += self._rng.normal(0, self.config.drift_per_min * np.sqrt(dt), len(self.ad_quality))
        self.t_s = max(self.t_s, t_s)

    def live_ads(self) -> np.ndarray:
        """The ads that can be shown now (the new campaign's once it launched)."""
        c = self.config
        return np.arange(c.ads + (c.new_campaign_ads if self.t_s >= c.new_campaign_at_s else 0))

    def is_new(self, ads: np.ndarray) -> np.ndarray:
        return ads >= self.config.ads

    def context(self, rng: np.random.Generator) -> tuple[int, int, int, int]:
        """Who asks: (user, site, device, hour)."""
        user = int(rng.choice(self.config.users, p=self._user_p))
        return (
            user,
            int(rng.integers(self.config.sites)),
            int(rng.choice(4, p=[0.5, 0.3, 0.15, 0.05])),
            int(
                (self.t_s / 15.0) % 24  # an hour of day passes every 15 s of the run
            ),
        )

    def candidates(self, k: int, rng: np.random.Generator) -> np.ndarray:
        """k different ads to score for one request."""
        live = self.live_ads()
        return rng.choice(live, size=min(k, len(live)), replace=False)

    def true_ctr(self, context: tuple[int, int, int, int], ads: np.ndarray) -> np.ndarray:
        """The chance each ad is clicked if shown in this context (n,)."""
        user, site, device, hour = context
        cats = self.ad_category[ads]
        logit = (
            self.bias
            + self.user_bias[user]
            + self.site_bias[site]
            + self.device_bias[device]
            + self.hour_category[hour, cats]
            + self.ad_quality[ads]
            + self.campaign_quality[self.ad_campaign[ads]]
            + self.category_factor[cats] @ self.user_taste[user]
        )
        return 1 / (1 + np.exp(-logit))

    def events(
        self, context: tuple[int, int, int, int], ads: np.ndarray, ids: list[str], ts_ms: int, rng: np.random.Generator
    ) -> list[dict[str, object]]:
        """The request's events as /predict takes them (criteo schema, no label)."""
        user, site, device, hour = context
        shared: dict[str, object] = {f"I{i}": None for i in range(1, 14)}
        shared.update({f"C{i}": None for i in range(1, 27)})
        shared.update(
            {
                "ts": ts_ms,
                "I1": hour,
                "I2": int(self.user_activity[user]),
                "C1": self._hex("C1", user),
                "C2": self._hex("C2", site),
                "C3": self._hex("C3", device),
                "C8": self._hex("C8", user % 64),
            }
        )
        out = []
        for ad, event_id in zip(ads.tolist(), ids):
            event = dict(shared)
            campaign = int(self.ad_campaign[ad])
            event.update(
                {
                    "event_id": event_id,
                    "C4": self._hex("C4", ad),
                    "C5": self._hex("C5", campaign),
                    "C6": self._hex("C6", campaign // 4),
                    "C7": self._hex("C7", int(self.ad_category[ad])),
                    **{f: self._hex(f, int(rng.integers(1000))) for f in NOISE_FIELDS},
                }
            )
            out.append(event)
        return out

    def click_delay_s(self, rng: np.random.Generator) -> float:
        c = self.config
        return float(min(c.max_delay_s, rng.lognormal(np.log(c.click_delay_median_s), c.click_delay_sigma)))

    def _hex(self, name: str, index: int) -> str:
        return f"{int(self.hex[name][index]):08x}"
