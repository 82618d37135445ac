# bash completion for egressd. The command line completes itself: urfave/cli
# answers --generate-bash-completion with the commands, subcommands or flags
# that may follow the words typed so far.

_egressd() {
	local cur words cword opts
	if declare -F _init_completion >/dev/null 2>&1; then
		_init_completion -n "=:" || return
	else
		COMPREPLY=()
		cur="${COMP_WORDS[COMP_CWORD]}"
		words=("${COMP_WORDS[@]}")
		cword=$COMP_CWORD
	fi
	words=("${words[@]:0:$cword}")
	if [[ "$cur" == -* ]]; then
		opts=$("${words[@]}" "$cur" --generate-bash-completion 2>/dev/null)
	else
		opts=$("${words[@]}" --generate-bash-completion 2>/dev/null)
	fi
	# Nothing to offer (a file or a value is expected): let bash complete
	# file names (-o default).
	mapfile -t COMPREPLY < <(compgen -W "$opts" -- "$cur")
}

complete -o bashdefault -o default -F _egressd egressd
