package policy

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// TestFieldsDescribeRule holds Fields to the rule's types: each field of
// a Rule, of its Scope and Shared, and of each shape a draft holds, is
// written by Format under a key of its own and read back as it was; and
// each field of Fields is one of them. A field added to the types without
// a description, which neither a file nor a flag could then set, fails
// here.
func TestFieldsDescribeRule(t *testing.T) {
	// A struct with a sample is a value; any other is walked.
	samples := map[reflect.Type]any{reflect.TypeFor[Destination](): mustDest(t, "10.0.0.1")}
	var rules []Rule
	var names []string
	var walk func(v reflect.Value, name string, set func(func(reflect.Value)) Rule)
	walk = func(v reflect.Value, name string, set func(func(reflect.Value)) Rule) {
		if s, ok := samples[v.Type()]; ok || v.Kind() != reflect.Struct {
			rules = append(rules, set(func(v reflect.Value) { v.Set(sample(t, name, v.Type(), s)) }))
			names = append(names, name)
			return
		}
		for i := range v.NumField() {
			f := v.Type().Field(i)
			if f.Type == reflect.TypeFor[Limit]() {
				continue // its shapes are the draft's
			}
			walk(v.Field(i), name+"."+f.Name, func(leaf func(reflect.Value)) Rule {
				return set(func(v reflect.Value) { leaf(v.Field(i)) })
			})
		}
	}
	walk(reflect.ValueOf(Rule{}), "Rule", func(leaf func(reflect.Value)) Rule {
		var r Rule
		leaf(reflect.ValueOf(&r).Elem())
		return r
	})
	// The shapes are the draft's fields that are limits.
	shapes := 0
	for i := range reflect.TypeFor[draft]().NumField() {
		f := reflect.TypeFor[draft]().Field(i)
		if !f.Type.Implements(reflect.TypeFor[Limit]()) {
			continue
		}
		shapes++
		walk(reflect.New(f.Type).Elem(), f.Type.Name(), func(leaf func(reflect.Value)) Rule {
			l := reflect.New(f.Type).Elem()
			leaf(l)
			return Rule{Limit: l.Interface().(Limit)}
		})
	}
	if shapes != 4 || len(rules) < 30 {
		t.Fatalf("found %d shapes and %d fields", shapes, len(rules))
	}

	written := map[string]string{} // a key → the Go field written under it
	for i, r := range rules {
		node := draftOf(r).node(topFields)
		keys := leafKeys(node, "")
		if len(keys) != 1 {
			t.Errorf("%s set alone writes %q, want one key: describe it in ruleFields", names[i], keys)
			continue
		}
		if other, ok := written[keys[0]]; ok {
			t.Errorf("%s and %s are both written as %s", other, names[i], keys[0])
		}
		written[keys[0]] = names[i]
		var dec decoder
		f := fields{d: &dec, w: newWhere(nil)}
		var got draft
		f.decode(node, "", "a rule", &got)
		if back := got.rule(f.w); len(dec.problems) > 0 || back != r {
			t.Errorf("%s: %+v reads back as %+v (%v)", names[i], r, back, dec.problems)
		}
	}
	for _, f := range ruleFields {
		if _, ok := written[f.Path]; f.value.write != nil && !ok {
			t.Errorf("field %s describes no field of the rule's types", f.Path)
		}
	}
}

// sample is a value of type typ that is not its zero: s when given.
func sample(t *testing.T, name string, typ reflect.Type, s any) reflect.Value {
	v := reflect.New(typ).Elem()
	switch {
	case s != nil:
		v.Set(reflect.ValueOf(s))
	case typ.Kind() == reflect.String:
		v.SetString("x")
	case typ.Kind() == reflect.Bool:
		v.SetBool(true)
	case v.CanInt():
		v.SetInt(1)
	case v.CanUint():
		v.SetUint(1)
	case v.CanFloat():
		v.SetFloat(1)
	default:
		t.Fatalf("%s: no sample value of %s; add one", name, typ)
	}
	return v
}

// leafKeys are the paths of the values a mapping holds that are not
// mappings themselves.
func leafKeys(n *yaml.Node, prefix string) []string {
	var keys []string
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i].Value, n.Content[i+1]
		if v.Kind == yaml.MappingNode {
			keys = append(keys, leafKeys(v, prefix+k+".")...)
		} else {
			keys = append(keys, prefix+k)
		}
	}
	return keys
}

// TestFieldsFlags: the flags a field needs are flags of other fields,
// and a flag names one field.
func TestFieldsFlags(t *testing.T) {
	var flags []string
	for _, f := range Fields() {
		if f.Flag != "" && slices.Contains(flags, f.Flag) {
			t.Errorf("--%s names two fields", f.Flag)
		}
		flags = append(flags, f.Flag)
	}
	for _, f := range Fields() {
		for _, need := range f.Needs {
			if need == f.Flag || !slices.Contains(flags, need) || strings.HasPrefix(need, "-") {
				t.Errorf("%s needs %q, which is not another field's flag", f.Path, need)
			}
		}
	}
}
