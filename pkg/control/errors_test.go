package control

import (
	"errors"
	"testing"
)

func TestErrorfWraps(t *testing.T) {
	cause := errors.New("bad cidr")
	err := Errorf(CodeInvalid, "rule %q: %w", "payments", cause)
	if err.Message != `rule "payments": bad cidr` || !errors.Is(err, cause) || !errors.Is(err, ErrInvalid) || errors.Is(err, ErrNotFound) {
		t.Errorf("Errorf: %#v", err)
	}
	if plain := Errorf(CodeNotFound, "no rule"); plain.Err != nil || !errors.Is(plain, ErrNotFound) {
		t.Errorf("Errorf without %%w: %#v", plain)
	}
}
