cd tests/python/vllm_plugin
export FRAGMENTS_VLLM_GRAPH_TAPS=slots FRAG_VLLM_RUNNER=v2 TORCHINDUCTOR_COMPILE_THREADS=2
i=0
for re in 'attention\.dense\.output|dense_4h_to_h\.output' 'attention\.dense\.input|dense_4h_to_h\.input'; do
  i=$((i+1)); python3 compiled_check.py gpt_neox 1 --only "$re" > $OUT/sweep$i.log 2>&1 &
done
wait
for i in 1 2; do echo "== $i"; grep -m1 "taps \[" $OUT/sweep$i.log | cut -c1-200; grep -E "^(ok|FAIL) +(read-only plan|no plan:)" $OUT/sweep$i.log | cut -c1-60; grep -o "exact [A-Za-z]*, max |dlogprob| [0-9.e+-]*" $OUT/sweep$i.log | head -2; done
