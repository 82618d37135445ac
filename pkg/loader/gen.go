package loader

//go:generate go tool bpf2go -tags linux -target bpfel -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" -type datapath_config -type rule_key -type rule -type rule_meta -type rule_state -type hist -type response_count -type sock_state -type merge_args -type refusal_note -type refusal_run -type sample -type iter_rec -type sweep_item -type sweep_args -type rule_counts -type counts_args -type udp_sock -type udp_flow -type udp_entry -type proto -type shape -type counter -type global_counter -type sample_kind -type rec_what egressd ../../bpf/egressd.c

// The datapath's rate arithmetic alone, for a test to run with BPF_PROG_RUN;
// its bindings are _test files, so the daemon never carries it.
//go:generate go tool bpf2go -tags linux -target bpfel -output-suffix _test -cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/x86_64-linux-gnu" -type step progrun ../../bpf/progrun.c
