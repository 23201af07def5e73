"""A cluster's `/metrics`: the ingress's own families (refusals before a request reaches a replica, admission, live
replicas), then each replica's families (runtime/server/metrics.py, counted on the replica) with a `replica` label,
one family per name whatever the number of replicas."""

from prometheus_client.metrics_core import Metric


class ReplicaLabelled:
    """A collector for prometheus_client's generate_latest."""

    def __init__(self, ingress, families: dict[str, list[Metric]]):
        self.ingress, self.families = ingress, families  # the ingress's registry; replica → its collected families

    def collect(self):
        own = list(self.ingress.collect())
        yield from own
        taken = {family.name for family in own}
        merged: dict[str, Metric] = {}
        for replica, families in self.families.items():
            for family in families:
                if family.name in taken:  # the ingress counts those; the replica's copy stays empty
                    continue
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples += [s._replace(labels={**s.labels, "replica": replica}) for s in family.samples]
        yield from merged.values()
