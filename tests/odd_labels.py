"""A test config whose metric label values need escaping (``odd_org_and_discovered_models``): the model ids
come from the mock upstream's own list, and an org's id holds a quote and a backslash."""


def odd_org_and_discovered_models(config: dict) -> None:
    """The test config with its model's ids taken from the mock's own list (``served_models``) and an org,
    with a key ``sk-odd``, whose id holds a quote and a backslash."""
    model = config["models"][0]
    model.update(id="", discover=True, upstream_model="mock-vllm")
    del model["reject_chat_params"]
    config["orgs"].append({"id": 'or"g\\x', "credits": 10.0})
    config["keys"].append({"key": "sk-odd", "org": 'or"g\\x', "id": "odd-key"})
