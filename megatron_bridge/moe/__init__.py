"""Expert routing of the MoE layers: capture and replay on megatron's routers (``routing``),
transformers' routing (``hf_routing``), and routing tables, the layout-independent form in which
routings are put together and compared (``table``)."""
