"""The Indexed Job's pod failure policy beyond its exit-code rules: Kubernetes applies the first
rule that matches, and an evicted or preempted pod (condition DisruptionTarget) must not count
against backoffLimit, whatever its container's exit status."""
from __future__ import annotations

from pretrain import k8s
from tests.test_k8s import ENV, _spec


def test_an_evicted_pod_is_ignored_before_any_exit_code_rule():
    *_, job = k8s.manifests(_spec(kind="indexed-job", scheduler="kueue", queue="q"), rank_env=ENV)
    rules = job["spec"]["podFailurePolicy"]["rules"]
    evicted = [i for i, rule in enumerate(rules) if "onPodConditions" in rule]
    assert len(evicted) == 1
    assert rules[evicted[0]] == {"action": "Ignore", "onPodConditions": [
        {"type": "DisruptionTarget", "status": "True"}]}
    counted = [i for i, rule in enumerate(rules) if rule["action"] == "Count"]
    assert counted and evicted[0] < min(counted)  # a killed pod's 137 must not be counted first
