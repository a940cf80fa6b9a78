"""deploy_graph fails a deploy Serve gave up on with the replica's own reason (a model the engine
can't load), instead of waiting out its timeout."""

from __future__ import annotations

from pdd_serve.cluster.deploy import deploy_failures


def test_deploy_failures_names_each_failed_deployment_with_its_reason():
    status = {
        "pdd": {"status": "DEPLOY_FAILED", "message": "Deploying app 'pdd' failed",
                "deployments": {
                    "Router": {"status": "DeploymentStatus.HEALTHY", "message": ""},
                    "MainDecode": {"status": "DeploymentStatus.DEPLOY_FAILED",
                                   "message": "RuntimeError: vLLM could not load /m: no model weights"}}},
        "other": {"status": "RUNNING", "message": "", "deployments": {}},
    }
    assert deploy_failures(status) == ["pdd/MainDecode: RuntimeError: vLLM could not load /m: no model weights"]
    assert deploy_failures({"a": {"status": "ApplicationStatus.DEPLOY_FAILED", "message": "bad import path",
                                  "deployments": {}}}) == ["a: bad import path"]
    assert deploy_failures({"a": {"status": "DEPLOYING", "message": "", "deployments": {
        "P": {"status": "UPDATING", "message": ""}}}}) == []
    assert deploy_failures({}) == []
